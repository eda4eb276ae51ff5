//! Differential tests: the engine against `tiktoken-rs` (tiktoken's own Rust core, with
//! its `fancy-regex` splitter), token for token.

use proptest::prelude::*;
use regex_syntax::hir::{Class, HirKind};

use super::*;

fn o200k() -> &'static Engine {
    engine(Encoding::O200kBase).unwrap()
}

fn cl100k() -> &'static Engine {
    engine(Encoding::Cl100kBase).unwrap()
}

fn reference(encoding: Encoding) -> &'static tiktoken_rs::CoreBPE {
    match encoding {
        Encoding::O200kBase => tiktoken_rs::o200k_base_singleton(),
        _ => tiktoken_rs::cl100k_base_singleton(),
    }
}

#[test]
fn built_in_vocabularies_equal_tiktoken_rs_rank_for_rank() {
    for (encoding, engine) in [
        (Encoding::O200kBase, o200k()),
        (Encoding::Cl100kBase, cl100k()),
    ] {
        let core = reference(encoding);
        let n = engine.vocab.len();
        for rank in 0..n as u32 {
            let expected = core.decode_bytes(&[rank]).unwrap();
            assert_eq!(engine.vocab.bytes(rank), expected, "{encoding} rank {rank}");
            assert_eq!(
                engine.vocab.rank(&expected),
                Some(rank),
                "{encoding} rank {rank}"
            );
        }
        // The next rank is no mergeable token: the vocabulary was not cut short.
        assert!(
            core.decode_bytes(&[n as u32]).is_err(),
            "{encoding}: {n} tokens"
        );
    }
}

#[test]
fn a_vocabulary_with_offsets_out_of_order_is_refused() {
    assert!(Vocab::new(Cow::Borrowed(b"abc"), vec![0, 2, 1, 3]).is_err());
    assert!(
        Vocab::new(Cow::Borrowed(b"abc"), vec![0, 1, 2]).is_err(),
        "stops short of the arena"
    );
    assert!(
        Vocab::new(Cow::Borrowed(b"abc"), vec![1, 2, 3]).is_err(),
        "does not start at 0"
    );
    assert!(Vocab::new(Cow::Borrowed(b"abc"), vec![]).is_err());
    assert!(
        Vocab::new(Cow::Borrowed(b"aa"), vec![0, 1, 2]).is_err(),
        "duplicate token"
    );
    let v = Vocab::new(Cow::Borrowed(b"abc"), vec![0, 1, 3]).unwrap();
    assert_eq!(
        (v.rank(b"a"), v.rank(b"bc"), v.rank(b"b")),
        (Some(0), Some(1), None)
    );
}

/// tiktoken's pre-tokenization regex for an encoding, compiled with `fancy-regex` as
/// tiktoken does.
fn regex(encoding: Encoding) -> &'static fancy_regex::Regex {
    static O200K_RE: OnceLock<fancy_regex::Regex> = OnceLock::new();
    static CL100K_RE: OnceLock<fancy_regex::Regex> = OnceLock::new();
    match encoding {
        Encoding::O200kBase => O200K_RE
            .get_or_init(|| fancy_regex::Regex::new(tiktoken_rs::O200K_BASE_PAT_STR).unwrap()),
        _ => CL100K_RE.get_or_init(|| {
            // OpenAI's cl100k_base pattern (tiktoken_ext/openai_public.py).
            fancy_regex::Regex::new(
                r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s",
            )
            .unwrap()
        }),
    }
}

/// Asserts our pieces equal tiktoken's regex matches, and our tokens and count equal
/// tiktoken's.
fn check(encoding: Encoding, text: &str) {
    let ours = engine(encoding).unwrap();
    let expected: Vec<&str> = regex(encoding)
        .find_iter(text)
        .map(|m| m.unwrap().as_str())
        .collect();
    assert_eq!(
        ours.pieces(text),
        expected,
        "{encoding}: pieces of {text:?}"
    );
    let theirs = reference(encoding).encode_ordinary(text);
    let tokens = ours.encode(text);
    if tokens != theirs {
        panic!(
            "{encoding}: tokens differ for {text:?}\n ours:   {tokens:?}\n theirs: {theirs:?}\n pieces: {:?}",
            ours.pieces(text)
        );
    }
    assert_eq!(
        ours.count(text),
        theirs.len(),
        "{encoding}: count of {text:?}"
    );
}

fn check_both(text: &str) {
    check(Encoding::O200kBase, text);
    check(Encoding::Cl100kBase, text);
}

#[test]
fn vocabularies_load_with_their_sizes() {
    assert_eq!(o200k().vocab_len(), 199_998);
    assert_eq!(cl100k().vocab_len(), 100_256);
    assert!(matches!(
        engine(Encoding::Approximate),
        Err(TokenError::NotBpe { .. })
    ));
}

#[test]
fn known_tricky_strings() {
    for text in [
        "",
        " ",
        "  ",
        "\n",
        "a",
        "hello world",
        "Hello World!!  \n\n  foo",
        "don't I'M we'LL they've she'd it's 'S 'ſ x'ſ",
        "x'ſa 'ſab it'sa I'Ma we'lla 'tx 'dx 'rex 'vex 'llx",
        "CamelCaseIdentifier HTTPServer iOS ǅemal",
        "12345678 1,234.56 ٣٤٥ Ⅻ",
        "   leading and trailing   ",
        "tabs\t\tand\r\nCRLF\r\n\r\n",
        "a\u{0301}e\u{0301} \u{0301}\u{0301}x",
        "中文字符测试，日本語のテキスト。한국어",
        "emoji 😀👍🏽 👨‍👩‍👧 !!!",
        "path/to/file.rs // comment\n/* block */",
        "<|endoftext|> is ordinary text here <|endofprompt|>",
        "fn main() {\n    println!(\"{}\", 1 + 2);\n}\n",
        " \u{a0}\u{2028}\u{3000} \u{200b}x",
        "!\n/x ;\n\n/ y",
    ] {
        check_both(text);
    }
}

#[test]
fn long_pieces_use_the_heap_merge_correctly() {
    let mut seed = 1u64;
    let mut next = || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (seed >> 33) as usize
    };
    let alphabet = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";
    for len in [100, 127, 128, 129, 500, 3000] {
        let word: String = (0..len)
            .map(|_| alphabet[next() % alphabet.len()] as char)
            .collect();
        check_both(&word);
        check_both(&"a".repeat(len));
        check_both(&"ab".repeat(len));
        check_both(&" ".repeat(len));
        check_both(&"!?".repeat(len));
    }
}

/// Pieces longer than a window are counted window by window: the joins must give the
/// count of the whole piece, on both vocabularies, with windows small enough that a
/// piece crosses dozens of them. A window pair that shares no token would fall back to
/// the whole merge (`None` here): none of these texts may need it.
#[test]
fn windowed_counts_equal_whole_counts() {
    let mut seed = 5u64;
    let mut next = move || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (seed >> 33) as usize
    };
    let mut pick = |set: &[&str], len: usize| -> String {
        let mut s = String::with_capacity(len + 8);
        while s.len() < len {
            s.push_str(set[next() % set.len()]);
        }
        s
    };
    let len = 20_000;
    let texts = [
        "a".repeat(len),
        "=".repeat(len),
        " ".repeat(len),
        "\0".repeat(len),
        "中".repeat(len / 3),
        "é".repeat(len / 2),
        "ab".repeat(len / 2),
        "abc".repeat(len / 3),
        "=-".repeat(len / 2),
        "\r\n".repeat(len / 2),
        pick(&["a", "b"], len),
        pick(&["a", "b", "c", "d", "e"], len),
        pick(
            &[
                "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog",
            ],
            len,
        ),
        pick(&["中", "文", "字", "符", "的", "是", "不", "了"], len),
        pick(&["=", "-", "_", "*", "#", "/", ".", ":", "!", "?"], len),
        pick(
            &["a", "Z", "0", "é", "\u{1F600}", " ", "\0", "=", "\u{0301}"],
            len,
        ),
    ];
    for (name, engine) in [("o200k", o200k()), ("cl100k", cl100k())] {
        for text in &texts {
            let piece = text.as_bytes();
            let whole = merge::count_whole(&engine.vocab, piece);
            for window in [512, 4_096] {
                assert_eq!(
                    merge::try_count_windowed(&engine.vocab, piece, window),
                    Some(whole),
                    "{name}, window {window}, text starting {:?}",
                    &text[..text.char_indices().nth(12).map_or(text.len(), |(i, _)| i)]
                );
            }
        }
    }
}

#[test]
fn real_source_text() {
    for text in [
        include_str!("mod.rs"),
        include_str!("split.rs"),
        include_str!("merge.rs"),
        include_str!("../lib.rs"),
        include_str!("../../Cargo.toml"),
    ] {
        check_both(text);
    }
}

/// Every codepoint where the Unicode class table changes (and its neighbours), in
/// contexts that exercise each alternative of both patterns.
#[test]
fn every_class_boundary_of_unicode() {
    let classes = CLASSES.get_or_init(Classes::build).as_ref().unwrap();
    let mut interesting = Vec::new();
    let mut previous = u8::MAX;
    for cp in 0..0x11_0000u32 {
        let k = classes.of(cp);
        if k != previous || cp < 0x300 {
            for c in cp.saturating_sub(1)..=cp + 1 {
                interesting.extend(char::from_u32(c));
            }
            previous = k;
        }
    }
    interesting.dedup();
    assert!(interesting.len() > 1000, "{}", interesting.len());
    for chunk in interesting.chunks(256) {
        let mut text = String::new();
        for &x in chunk {
            // letter/upper/lower/number/space/prefix/punctuation/suffix contexts
            text.extend([
                'x', x, 'y', ' ', x, 'Z', x, x, '1', ' ', x, '\t', x, '9', 'a', '\'', x, 'q', '\'',
                x, ' ', x, '\n', x, ':', x,
            ]);
        }
        check_both(&text);
    }
}

/// The only non-ASCII char that `(?i)` makes match one of the contraction letters is
/// `ſ` (for `s`), which the matchers handle.
#[test]
fn case_folding_of_contraction_letters() {
    let hir = regex_syntax::ParserBuilder::new()
        .build()
        .parse("(?i)[stremvld]")
        .unwrap();
    let HirKind::Class(Class::Unicode(class)) = hir.kind() else {
        panic!("not a class")
    };
    let chars: Vec<char> = class
        .ranges()
        .iter()
        .flat_map(|r| r.start()..=r.end())
        .filter(|c| !c.is_ascii())
        .collect();
    assert_eq!(chars, vec!['ſ']);
}

#[test]
fn safe_split_cuts_only_where_pieces_end() {
    let text = include_str!("split.rs").repeat(3);
    for e in [o200k(), cl100k()] {
        let chunks = e.safe_split(&text, 7);
        assert!(chunks.len() > 3);
        assert_eq!(chunks.concat(), text);
        let split: usize = chunks.iter().map(|c| e.count(c)).sum();
        assert_eq!(split, e.count(&text));
        assert_eq!(
            e.count_parallel(&text.repeat(30), 2),
            e.count(&text.repeat(30))
        );
    }
}

fn nasty_char() -> impl Strategy<Value = char> {
    prop::sample::select(vec![
        'a', 'b', 'z', 'A', 'Z', 'ǅ', 'ʰ', '中', 'é', '\u{0301}', '\u{093f}', '1', '٣', 'Ⅳ', '½',
        ' ', ' ', ' ', '\t', '\n', '\n', '\r', '\u{a0}', '\u{2028}', '\u{3000}', '\u{200b}', '\'',
        's', 'S', 'ſ', 't', 'l', 'L', 'r', 'e', 'v', 'm', 'd', '/', '!', '.', ',', '(', '{', '"',
        '😀', '\u{fe0f}', '$', '_', '-',
    ])
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn same_tokens_as_tiktoken(chars in prop::collection::vec(nasty_char(), 0..80)) {
        let text: String = chars.into_iter().collect();
        check_both(&text);
    }

    /// Any bytes, from a few chars (so runs and repeats are common): windowed counting
    /// (falling back to the whole merge should two windows share no token) equals the
    /// whole merge.
    #[test]
    fn windowed_counts_equal_whole_counts_on_any_text(
        alphabet in prop::collection::vec(nasty_char(), 1..6),
        picks in prop::collection::vec(any::<prop::sample::Index>(), 600..2_000),
        window in 300usize..1_200,
    ) {
        let text: String = picks.iter().map(|i| *i.get(&alphabet)).collect();
        for engine in [o200k(), cl100k()] {
            let piece = text.as_bytes();
            prop_assert_eq!(
                merge::count_windowed(&engine.vocab, piece, window),
                merge::count_whole(&engine.vocab, piece)
            );
        }
    }

    #[test]
    fn same_tokens_on_arbitrary_strings(text in ".{0,60}") {
        check_both(&text);
    }

    #[test]
    fn chunked_counts_equal_whole_counts(
        chars in prop::collection::vec(nasty_char(), 0..200),
        parts in 2usize..9,
    ) {
        let text: String = chars.into_iter().collect();
        for (encoding, e) in [(Encoding::O200kBase, o200k()), (Encoding::Cl100kBase, cl100k())] {
            let chunks = e.safe_split(&text, parts);
            prop_assert_eq!(chunks.concat(), text.clone());
            let tokens: Vec<u32> = chunks.iter().flat_map(|c| e.encode(c)).collect();
            prop_assert_eq!(tokens, reference(encoding).encode_ordinary(&text));
        }
    }
}

#[test]
fn the_piece_cache_keeps_each_encoding_apart() {
    // The same pieces under both vocabularies, on one thread, in turns: each count is
    // its own encoding's (a piece cached by one engine is never answered to the other).
    let text = "fn main() {\n    let résumé = \"naïve café\"; // 12345 !!! ???\n}\n".repeat(20);
    for _ in 0..3 {
        for encoding in [Encoding::O200kBase, Encoding::Cl100kBase] {
            let e = engine(encoding).unwrap();
            let expected = reference(encoding).encode_ordinary(&text).len();
            assert_eq!(e.count(&text), expected, "{encoding}");
            assert_eq!(e.count_uncached(&text), expected, "{encoding}");
        }
    }
}

#[test]
fn counting_inside_a_count_on_the_same_thread_goes_without_the_cache() {
    let e = o200k();
    let text = "the quick brown fox jumps over the lazy dog";
    let expected = reference(Encoding::O200kBase).encode_ordinary(text).len();
    let (outer_had_cache, inner) = cache::with(e.id, |outer| (outer.is_some(), e.count(text)));
    assert!(outer_had_cache);
    assert_eq!(inner, expected);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn cached_counts_equal_uncached_counts(
        words in prop::collection::vec(prop::collection::vec(nasty_char(), 1..18), 1..40),
    ) {
        // Short repeated pieces (the cache's whole business), counted twice so the
        // second pass is answered from the cache.
        let text: String = words
            .iter()
            .cycle()
            .take(words.len() * 3)
            .map(|w| w.iter().collect::<String>())
            .collect::<Vec<_>>()
            .join(" ");
        for e in [o200k(), cl100k()] {
            let uncached = e.count_uncached(&text);
            prop_assert_eq!(e.count(&text), uncached);
            prop_assert_eq!(e.count(&text), uncached);
        }
    }
}
