#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! Exact counts, chat framing arithmetic, and hostile input.

use std::sync::Arc;

use keel_message::{ContentPart, Message, ToolArguments, ToolCall, ToolSpec};
use keel_token::{ApproxCounter, Encoding, Framing, TiktokenCounter, TokenCounter};
use serde_json::json;

/// `(text, o200k_base, cl100k_base)`.
///
/// Ground truth from Python `tiktoken` 0.14.0, `Encoding.encode_ordinary(text)`, with
/// each encoding built from the `.tiktoken` file shipped in tiktoken-rs 0.12.1 (whose
/// SHA-256 matches the hash `tiktoken_ext.openai_public` expects), run once and pasted
/// here.
const KNOWN: &[(&str, usize, usize)] = &[
    ("", 0, 0),
    ("Hello, world!", 4, 4),
    ("tiktoken is great!", 6, 6),
    ("<|endoftext|>", 7, 7),
    ("The quick brown fox jumps over the lazy dog.", 10, 10),
    ("fn main() {\n    println!(\"Hello, world!\");\n}\n", 12, 12),
    ("Grüße aus Köln — 東京で会いましょう 🙂", 13, 19),
    ("   leading spaces and trailing   \n\n\n", 7, 7),
    ("1234567890 3.14159", 9, 9),
    ("I'm sure they'll say it's fine, don't you think?", 11, 15),
    (r#"{"city": "Paris", "units": "metric"}"#, 12, 12),
    ("user", 1, 1),
    ("assistant", 1, 1),
    ("system", 1, 1),
    ("tool", 1, 1),
];

fn o200k() -> TiktokenCounter {
    TiktokenCounter::o200k_base().unwrap()
}

fn cl100k() -> TiktokenCounter {
    TiktokenCounter::cl100k_base().unwrap()
}

#[test]
fn exact_counts_match_python_tiktoken() {
    let (o, c) = (o200k(), cl100k());
    for &(text, want_o200k, want_cl100k) in KNOWN {
        assert_eq!(o.count_text(text), want_o200k, "o200k_base: {text:?}");
        assert_eq!(c.count_text(text), want_cl100k, "cl100k_base: {text:?}");
    }
}

#[test]
fn counts_equal_tiktoken_rs_on_this_crates_sources() {
    let sources = [
        include_str!("../src/lib.rs"),
        include_str!("../src/counter.rs"),
        include_str!("../src/engine/split.rs"),
        include_str!("counting.rs"),
    ];
    for text in sources {
        assert_eq!(
            o200k().count_text(text),
            tiktoken_rs::o200k_base_singleton()
                .encode_ordinary(text)
                .len()
        );
        assert_eq!(
            cl100k().count_text(text),
            tiktoken_rs::cl100k_base_singleton()
                .encode_ordinary(text)
                .len()
        );
    }
}

#[test]
fn encodings_and_errors() {
    assert_eq!(o200k().encoding(), Encoding::O200kBase);
    assert_eq!(cl100k().encoding(), Encoding::Cl100kBase);
    let err = TiktokenCounter::new(Encoding::Approximate).unwrap_err();
    assert_eq!(err.to_string(), "`approximate` is not a BPE encoding");
}

#[test]
fn approx_weighs_pieces_and_adds_a_quarter() {
    let a = ApproxCounter::new();
    for (text, want) in [
        ("", 0),
        ("a", 2),           // a word: 1, and a quarter, rounded up
        ("hello", 2),       // one word
        ("hello world", 3), // two words (the space is part of the second): 2.5
        ("12345", 3),       // two groups of digits: 2.5
        ("ééééé", 4),       // 5 accented letters of 1/2: 3.125
        ("東京東京", 5),    // 4 characters of 1: 5
        ("🙂🙂", 10),       // 2 characters of 4 (a token a byte): 10
    ] {
        assert_eq!(a.count_text(text), want, "{text:?}");
    }
    assert_eq!(a.with_chars_per_token(0).chars_per_token(), 1);
    assert_eq!(a.with_chars_per_token(2).count_text("abcde"), 3);
}

/// Texts of the kinds an agent's context holds, from a fixed-seed generator.
fn kinds() -> Vec<(&'static str, String)> {
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut hex = |n: usize| -> String { (0..n).map(|_| format!("{:x}", next() % 16)).collect() };
    let sha: String = (0..60)
        .map(|i| format!("{}  src/file_{i}.rs\n", hex(64)))
        .collect();
    let xxd: String = (0..50)
        .map(|i| {
            let groups: Vec<String> = (0..8).map(|_| hex(4)).collect();
            format!("{:08x}: {}  ................\n", i * 16, groups.join(" "))
        })
        .collect();
    let git: String = (0..30)
        .map(|i| {
            format!(
                "commit {}\nAuthor: Dev <dev@example.com>\n\n    Fix module {i}\n\n",
                hex(40)
            )
        })
        .collect();
    let uuids: String = (0..50)
        .map(|_| format!("{}-{}-{}-{}-{}\n", hex(8), hex(4), hex(4), hex(4), hex(12)))
        .collect();
    let mut next = {
        let mut y: u64 = 0x2545_F491_4F6C_DD1D;
        move || {
            y ^= y << 13;
            y ^= y >> 7;
            y ^= y << 17;
            y
        }
    };
    const B64: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let base64: String = (0..4000)
        .map(|_| B64[(next() % 64) as usize] as char)
        .collect();
    let numbers: String = (0..400)
        .map(|_| format!("{} ", next() % 1_000_000))
        .collect();
    let printable: String = (0..2000)
        .map(|_| (0x21 + (next() % 94) as u8) as char)
        .collect();
    const PUNCT: &[u8] = b"!#$%&()*+,-./:;<=>?@[]^_{|}~";
    let punct: String = (0..1000)
        .map(|_| PUNCT[(next() % 28) as usize] as char)
        .collect();
    let unicode: String = (0..500)
        .filter_map(|_| char::from_u32((next() % 0x2FFFF) as u32))
        .filter(|c| !c.is_control())
        .collect();
    let logs: String = (0..100)
        .map(|i| format!("note: line {i} of step {}\n", i * 7))
        .collect();
    vec![
        ("prose", "The build fails because the linker cannot find zlib; install the development package and run make again. ".repeat(20)),
        ("json", r#"{"id": 12345, "name": "widget", "tags": ["a", "b"], "price": 9.99, "in_stock": true}"#.repeat(20)),
        ("code", "fn main() {\n    let x = vec![1, 2, 3];\n    for i in &x { println!(\"{i}\"); }\n}\n".repeat(20)),
        ("camel case", "getUserAccountSettingsById parseHttpResponseHeaderV2 XMLHttpRequestFactory ".repeat(20)),
        ("paths", "/usr/lib/x86_64-linux-gnu/libz.so.1.2.13 /home/dev/proj/target/debug/deps/libfoo-3f2a9c1b.rlib\n".repeat(20)),
        ("log lines", logs),
        ("numbers", numbers),
        ("sha256sum", sha),
        ("xxd", xxd),
        ("git log", git),
        ("uuids", uuids),
        ("hex", "a1b2c3d4e5f60718293a4b5c6d7e8f90".repeat(20)),
        ("base64", base64),
        ("printable ASCII", printable),
        ("symbols", punct),
        ("spaces", " ".repeat(1000)),
        ("dashes", "-".repeat(1000)),
        ("combining marks", "e\u{301}".repeat(100)),
        ("Canadian syllabics", "ᐊᐃᐅᐁᐸᐱᐳᐯᑕᑎᑐᑌ".repeat(20)),
        ("emoji", "🙂🚀👍🏽".repeat(50)),
        ("random Unicode", unicode),
        ("Chinese", "这是一个测试文本，用于检查分词器的行为。".repeat(20)),
        ("Japanese", "リンカーがライブラリを見つけられなかったため、ビルドに失敗しました。".repeat(20)),
        ("Korean", "링커가 라이브러리를 찾지 못해 빌드가 실패했습니다. ".repeat(20)),
        ("Russian", "Сборка не удалась, потому что компоновщик не нашёл библиотеку. ".repeat(20)),
        ("Greek", "Η κατασκευή απέτυχε επειδή ο σύνδεσμος δεν βρήκε τη βιβλιοθήκη. ".repeat(20)),
        ("Arabic", "فشل البناء لأن الرابط لم يجد المكتبة المطلوبة. ".repeat(20)),
        ("Hebrew", "הבנייה נכשלה כי המקשר לא מצא את הספרייה. ".repeat(20)),
        ("Hindi", "बिल्ड विफल हुआ क्योंकि लिंकर को लाइब्रेरी नहीं मिली। ".repeat(20)),
        ("Thai", "การสร้างล้มเหลวเพราะตัวเชื่อมโยงไม่พบไลบรารี ".repeat(20)),
        ("French", "La compilation a échoué parce que l'éditeur de liens n'a pas trouvé la bibliothèque. ".repeat(20)),
        ("box drawing", "├── src\n│   └── main.rs\n".repeat(20)),
    ]
}

/// The estimate a prompt budget trusts never counts under the OpenAI encodings on
/// what agents see (a count under the truth lets a prompt overflow the window), and
/// stays within about twice them on English, JSON and code.
#[test]
fn approx_is_at_or_above_both_encodings_and_near_them_on_english_json_and_code() {
    let (a, o, c) = (ApproxCounter::new(), o200k(), cl100k());
    for (kind, text) in kinds() {
        let (est, exact_o, exact_c) = (
            a.count_text(&text),
            o.count_text(&text),
            c.count_text(&text),
        );
        assert!(
            est >= exact_o && est >= exact_c,
            "{kind}: estimate {est} under o200k {exact_o} or cl100k {exact_c}"
        );
        assert!(
            a.max_tokens(&text).is_some_and(|bound| bound >= est),
            "{kind}: the cheap bound is under the estimate"
        );
        if matches!(
            kind,
            "prose" | "json" | "code" | "log lines" | "paths" | "numbers"
        ) {
            assert!(
                est * 10 <= exact_o * 16,
                "{kind}: estimate {est}, o200k {exact_o}"
            );
        }
    }
}

/// One token per char: makes framing arithmetic easy to read.
struct PerChar;

impl TokenCounter for PerChar {
    fn count_text(&self, text: &str) -> usize {
        text.chars().count()
    }
}

#[test]
fn message_framing_arithmetic() {
    let f = Framing::OPENAI;
    assert_eq!((f.per_message, f.per_name, f.reply_priming), (3, 1, 3));
    let check = |m: &Message, want: usize| assert_eq!(PerChar.count_message(m), want, "{m:?}");

    // 3 + "user" (4) + "hi" (2)
    check(&Message::user("hi"), 9);
    // + "bob" (3) + 1 for the name
    check(&Message::user("hi").with_name("bob"), 13);
    // 3 + "assistant" (9) + "" + calls: "ls" (2) + {"p":"."} (9) and "rm" (2) + "{x" (2)
    check(
        &Message::assistant("").with_tool_calls(vec![
            ToolCall::new("c1", "ls", json!({"p": "."})),
            ToolCall::from_raw_arguments("c2", "rm", "{x"),
        ]),
        3 + 9 + 2 + 9 + 2 + 2,
    );
    // Raw JSON text is counted as sent, spaces included: {"p": "."} is 10 chars.
    let raw = ToolCall::from_raw_arguments("c3", "ls", r#"{"p": "."}"#);
    assert!(matches!(raw.arguments, ToolArguments::JsonText { .. }));
    check(
        &Message::assistant("").with_tool_calls(vec![raw]),
        3 + 9 + 2 + 10,
    );
    // 3 + "tool" (4) + "ok" (2) + the id it answers "c1" (2)
    check(&Message::tool("c1", "ok"), 11);
    // Parts: text joined ("ab"), an image at 85, another part as its JSON.
    let other = json!({"type": "input_audio", "data": "x"});
    let parts = Message::user(vec![
        ContentPart::text("a"),
        ContentPart::Image {
            url: "https://x/y.png".into(),
            detail: None,
        },
        ContentPart::text("b"),
        ContentPart::Other(other.clone()),
    ]);
    check(&parts, 3 + 4 + 2 + 85 + other.to_string().chars().count());
}

#[test]
fn prompt_framing_arithmetic() {
    let history = [Message::system("be brief"), Message::user("hi")];
    let per_message = (3 + 6 + 8) + (3 + 4 + 2);
    // The reply priming is added once per prompt, even an empty one.
    assert_eq!(PerChar.count_messages(&history), per_message + 3);
    assert_eq!(PerChar.count_messages(&[]), 3);

    let spec = ToolSpec::new("ls", "List.", json!({"type": "object"}));
    let json = json!({"name": "ls", "description": "List.", "parameters": {"type": "object"}});
    let per_tool = json.to_string().chars().count() + 8;
    assert_eq!(PerChar.count_tool(&spec), per_tool);
    assert_eq!(
        PerChar.count_tools(&[spec.clone(), spec.clone()]),
        2 * per_tool
    );
    assert_eq!(
        PerChar.count_prompt(&history, &[spec]),
        per_message + 3 + per_tool
    );

    // Framing::NONE leaves only text.
    let bare = ApproxCounter::new()
        .with_chars_per_token(1)
        .with_framing(Framing::NONE);
    assert_eq!(bare.count_messages(&history), 6 + 8 + 4 + 2);
}

#[test]
fn real_encoder_framing_matches_the_cookbook_formula() {
    let o = o200k();
    let history = [
        Message::system("You are a helpful assistant."),
        Message::user("Hello, world!").with_name("ann"),
    ];
    let text = |s: &str| o.count_text(s);
    let want = (3 + text("system") + text("You are a helpful assistant."))
        + (3 + text("user") + text("Hello, world!") + text("ann") + 1)
        + 3;
    assert_eq!(o.count_messages(&history), want);
}

#[test]
fn pointers_and_trait_objects_forward_every_method() {
    let history = [Message::user("Hello, world!")];
    let direct = o200k().count_messages(&history);
    let shared: Arc<dyn TokenCounter> = Arc::new(o200k());
    let boxed: Box<dyn TokenCounter> = Box::new(o200k());
    assert_eq!(shared.count_messages(&history), direct);
    assert_eq!(boxed.count_messages(&history), direct);
    let owned = o200k();
    let by_ref: &dyn TokenCounter = &&owned;
    assert_eq!(by_ref.count_messages(&history), direct);
    let custom = o200k().with_framing(Framing::NONE);
    let shared: Arc<dyn TokenCounter> = Arc::new(custom.clone());
    assert_eq!(shared.framing(), Framing::NONE);
    assert_eq!(
        shared.count_messages(&history),
        custom.count_messages(&history)
    );
}

/// A unit that starts with a letter and ends with a newline, so repeating it puts a
/// piece boundary between copies: the count of `k` copies is exactly `k` times the
/// count of one.
const UNIT: &str = "Prose with ünïcödé, 東京 and emoji 🙂; code: fn f(x: u32) -> u32 { x * 2 }\n\
                    Numbers 1234567 and contractions: it's, we'll, they've.\n";

#[test]
fn fifty_megabytes_in_one_message() {
    let copies = 50 * 1024 * 1024 / UNIT.len() + 1;
    let text = UNIT.repeat(copies);
    assert!(text.len() >= 50 * 1024 * 1024);
    for counter in [o200k().with_threads(2), cl100k().with_threads(2)] {
        let one = counter.count_text(UNIT);
        let message = Message::tool("call_1", text.as_str());
        assert_eq!(
            counter.count_message(&message),
            3 + 1 + one * copies + counter.count_text("call_1")
        );
    }
    let flat = ApproxCounter::new().with_chars_per_token(4);
    assert_eq!(
        flat.count_text(&text),
        (UNIT.chars().count() * copies).div_ceil(4)
    );
    // By class: the unit's weight, rounded up once for the whole text.
    let (approx, unit) = (ApproxCounter::new(), ApproxCounter::new().count_text(UNIT));
    let whole = approx.count_text(&text);
    assert!(whole <= unit * copies && whole + copies >= unit * copies);
}

#[test]
fn pathological_single_pieces_do_not_blow_up() {
    // One 1 MiB letter run and one 1 MiB whitespace run: each is a single piece that
    // goes through the heap-based merge.
    let n = 1024 * 1024;
    for counter in [o200k(), cl100k()] {
        for text in ["a".repeat(n), " ".repeat(n), "\u{301}".repeat(n / 2)] {
            let tokens = counter.count_text(&text);
            // Every token covers at least one byte and at most the longest token.
            assert!(tokens > 0 && tokens <= text.len(), "{tokens}");
            assert!(tokens >= text.len() / 1024, "{tokens}");
        }
    }
}

#[test]
fn empty_and_odd_messages() {
    let o = o200k();
    assert_eq!(o.count_text(""), 0);
    assert_eq!(o.count_message(&Message::user("")), 3 + 1);
    let weird = Message::user("\u{0}\u{feff}\u{200b}\u{10ffff}\r\n\t");
    assert_eq!(
        o.count_message(&weird),
        3 + 1
            + tiktoken_rs::o200k_base_singleton()
                .encode_ordinary("\u{0}\u{feff}\u{200b}\u{10ffff}\r\n\t")
                .len()
    );
}

proptest::proptest! {
    /// `max_tokens` is a bound `count_text` never exceeds, for every counter that
    /// gives one, through every pointer and the memo.
    #[test]
    fn max_tokens_bounds_the_count(text in "\\PC{0,200}|[ a-z0-9{}\":,\\n]{0,400}") {
        let counters: Vec<Arc<dyn TokenCounter>> = vec![
            Arc::new(o200k()),
            Arc::new(cl100k()),
            Arc::new(ApproxCounter::new()),
            Arc::new(ApproxCounter::new().with_chars_per_token(3)),
            Arc::new(keel_token::MemoCounter::new(o200k())),
            Arc::new(keel_token::CalibratedCounter::new(ApproxCounter::new())),
        ];
        for counter in counters {
            let bound = counter.max_tokens(&text);
            proptest::prop_assert!(bound.is_some());
            proptest::prop_assert!(counter.count_text(&text) <= bound.unwrap_or(0));
        }
    }
}

#[test]
fn a_counter_without_a_bound_says_so() {
    struct Words;
    impl TokenCounter for Words {
        fn count_text(&self, text: &str) -> usize {
            text.split_whitespace().count()
        }
    }
    assert_eq!(Words.max_tokens("a b c"), None);
    let shared: Arc<dyn TokenCounter> = Arc::new(Words);
    assert_eq!(shared.max_tokens("a b c"), None);
    assert_eq!(Box::new(o200k()).max_tokens("abc"), Some(3));
}

/// The estimate against o200k_base and cl100k_base on the kinds of text an agent's
/// prompt holds: never under either (a prompt it says fits does fit), and within
/// twice the larger. A flat four characters a token undercounts JSON and Chinese or
/// Japanese text.
#[test]
fn the_estimate_leans_high_on_json_code_and_cjk_text() {
    let exact = TiktokenCounter::o200k_base().unwrap();
    let older = TiktokenCounter::cl100k_base().unwrap();
    let approx = ApproxCounter::new();
    let flat = ApproxCounter::new().with_chars_per_token(4);
    let samples = [
        "An error occurred while deploying the service: the log shows that the connection to the database timed out. Check the host address and port in the configuration file.",
        r#"{"id": 48213, "status": "failed", "retries": [1, 2, 4, 8], "host": "db-7.internal:5432", "elapsed_ms": 30012.5}"#,
        "fn main() {\n    let x: Vec<u32> = (0..10).map(|i| i * 2).collect();\n    println!(\"{:?}\", x);\n}\n",
        "我们在部署服务的时候发现了一个错误，日志显示连接数据库超时，需要检查配置文件中的主机地址和端口号是否正确。",
        "サービスをデプロイしたところ、エラーが発生しました。ログにはデータベースへの接続がタイムアウトしたと表示されています。",
        "При развёртывании сервиса возникла ошибка: в журнале указано, что время подключения к базе данных истекло.",
    ];
    for text in samples {
        let e = exact.count_text(text).max(older.count_text(text));
        let a = approx.count_text(text);
        assert!(e <= a && a <= 2 * e, "{a} estimated against {e}: {text}");
        assert!(approx.max_tokens(text).unwrap() >= a);
    }
    // What a flat ratio makes of the JSON and the Chinese.
    for text in [samples[1], samples[3]] {
        assert!(
            flat.count_text(text) * 3 / 2 < exact.count_text(text),
            "{text}"
        );
    }
}
