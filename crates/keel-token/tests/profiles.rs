#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! Model profiles: exact and prefix lookup, unknown models, overrides, counter choice.

use keel_token::{Encoding, ModelProfile, ModelProfiles, TokenCounter, builtin_profiles};

/// `model` resolves to the profile registered as `name` with these figures.
fn check(
    profiles: &ModelProfiles,
    model: &str,
    name: &str,
    window: usize,
    output: usize,
    enc: Encoding,
) {
    let p = profiles.lookup(model);
    assert_eq!(
        (
            p.name.as_str(),
            p.context_window,
            p.max_output_tokens,
            p.encoding
        ),
        (name, window, output, enc),
        "lookup({model:?})"
    );
}

#[test]
fn builtin_figures() {
    use Encoding::*;
    let p = ModelProfiles::new();
    check(&p, "gpt-4.1", "gpt-4.1", 1_047_576, 32_768, O200kBase);
    check(&p, "gpt-4o", "gpt-4o", 128_000, 16_384, O200kBase);
    check(&p, "gpt-4o-mini", "gpt-4o-mini", 128_000, 16_384, O200kBase);
    check(&p, "o3", "o3", 200_000, 100_000, O200kBase);
    check(&p, "gpt-4", "gpt-4", 8_192, 8_192, Cl100kBase);
    check(
        &p,
        "gpt-3.5-turbo",
        "gpt-3.5-turbo",
        16_385,
        4_096,
        Cl100kBase,
    );
    check(
        &p,
        "claude-sonnet-4-5",
        "claude-sonnet-4-5",
        200_000,
        64_000,
        Approximate,
    );
    check(
        &p,
        "claude-sonnet-4.5",
        "claude-sonnet-4.5",
        200_000,
        64_000,
        Approximate,
    );
    check(
        &p,
        "claude-opus-4-1",
        "claude-opus-4-1",
        200_000,
        32_000,
        Approximate,
    );
    check(&p, "llama3", "llama3", 8_192, 2_048, Approximate);
    check(&p, "llama3.1", "llama3.1", 131_072, 4_096, Approximate);
    check(
        &p,
        "qwen2.5-coder",
        "qwen2.5-coder",
        32_768,
        8_192,
        Approximate,
    );
    check(&p, "mistral", "mistral", 32_768, 4_096, Approximate);
    assert!(
        builtin_profiles()
            .iter()
            .all(|p| p.max_output_tokens <= p.context_window)
    );
}

#[test]
fn longest_prefix_wins() {
    use Encoding::*;
    let p = ModelProfiles::new();
    check(
        &p,
        "gpt-4o-2024-08-06",
        "gpt-4o",
        128_000,
        16_384,
        O200kBase,
    );
    check(
        &p,
        "gpt-4o-mini-x",
        "gpt-4o-mini",
        128_000,
        16_384,
        O200kBase,
    );
    check(
        &p,
        "gpt-4.1-mini-2025-04-14",
        "gpt-4.1-mini",
        1_047_576,
        32_768,
        O200kBase,
    );
    check(&p, "gpt-4-0613", "gpt-4", 8_192, 8_192, Cl100kBase);
    check(
        &p,
        "gpt-4-turbo-2024-04-09",
        "gpt-4-turbo",
        128_000,
        4_096,
        Cl100kBase,
    );
    check(&p, "o3-2025-04-16", "o3", 200_000, 100_000, O200kBase);
    check(
        &p,
        "claude-sonnet-4-5-20250929",
        "claude-sonnet-4-5",
        200_000,
        64_000,
        Approximate,
    );
    check(
        &p,
        "claude-opus-4-1-20250805",
        "claude-opus-4-1",
        200_000,
        32_000,
        Approximate,
    );
    check(&p, "llama3:8b", "llama3", 8_192, 2_048, Approximate);
    check(
        &p,
        "llama3.1:8b-instruct-q4_K_M",
        "llama3.1",
        131_072,
        4_096,
        Approximate,
    );
    check(
        &p,
        "qwen2.5-coder:7b",
        "qwen2.5-coder",
        32_768,
        8_192,
        Approximate,
    );
    check(
        &p,
        "mistral:7b-instruct-v0.3",
        "mistral",
        32_768,
        4_096,
        Approximate,
    );
    // Case and provider prefixes.
    check(&p, "GPT-4o", "gpt-4o", 128_000, 16_384, O200kBase);
    check(
        &p,
        "openai/gpt-4.1",
        "gpt-4.1",
        1_047_576,
        32_768,
        O200kBase,
    );
    check(
        &p,
        "meta-llama/Meta-Llama-3.1-8B-Instruct",
        "meta-llama-3.1",
        131_072,
        4_096,
        Approximate,
    );
}

#[test]
fn unknown_models_get_the_default_and_overrides_win() {
    let mut p = ModelProfiles::new();
    assert!(p.get("acme-7b").is_none());
    assert!(p.get("").is_none());
    let d = p.lookup("acme-7b");
    assert_eq!(d, &ModelProfiles::conservative_default());
    assert_eq!(
        (d.context_window, d.max_output_tokens, d.encoding),
        (8_192, 2_048, Encoding::Approximate)
    );

    // A user default.
    p.set_default(ModelProfile::new(
        "fallback",
        4_096,
        1_024,
        Encoding::Cl100kBase,
    ));
    assert_eq!(p.lookup("acme-7b").name, "fallback");

    // Register a new family, then override a built-in.
    assert!(
        p.register(ModelProfile::new(
            "acme",
            65_536,
            8_192,
            Encoding::Approximate
        ))
        .is_none()
    );
    assert_eq!(p.lookup("acme-7b").context_window, 65_536);
    let old = p.register(ModelProfile::new(
        "GPT-4o",
        64_000,
        4_000,
        Encoding::O200kBase,
    ));
    assert_eq!(old.unwrap().context_window, 128_000);
    assert_eq!(p.lookup("gpt-4o-2024-08-06").context_window, 64_000);
    // gpt-4o-mini is still its own, longer prefix.
    assert_eq!(p.lookup("gpt-4o-mini").context_window, 128_000);
    assert!(p.remove("acme").is_some());
    assert_eq!(p.lookup("acme-7b").name, "fallback");

    let empty = ModelProfiles::empty(ModelProfiles::conservative_default());
    assert_eq!(empty.iter().count(), 0);
    assert_eq!(empty.lookup("gpt-4o").name, "default");
    assert_eq!(p.clone().lookup("gpt-4o").context_window, 64_000);
}

#[test]
#[cfg(feature = "tiktoken")]
fn counters_follow_the_encoding() {
    let p = ModelProfiles::new();
    let text = "I'm sure they'll say it's fine, don't you think?";
    // Exact counts from Python tiktoken (see tests/counting.rs).
    assert_eq!(p.lookup("gpt-4.1").counter().unwrap().count_text(text), 11);
    assert_eq!(p.lookup("o3").counter().unwrap().count_text(text), 11);
    assert_eq!(p.lookup("gpt-4").counter().unwrap().count_text(text), 15);
    // An estimate: 14 words and 5 symbols of a token each, and a quarter more.
    assert_eq!(p.lookup("mistral").counter().unwrap().count_text(text), 24);
    assert_eq!(p.lookup("acme").counter().unwrap().count_text(text), 24);
    assert_eq!(p.lookup("gpt-4.1").input_budget(), 1_047_576 - 32_768);
    // And the profiles say so.
    assert!(p.lookup("gpt-4.1").counts_exactly());
    assert!(p.lookup("gpt-4").counts_exactly());
    assert!(!p.lookup("mistral").counts_exactly());
    assert!(!p.lookup("acme").counts_exactly());
}

#[test]
#[cfg(not(feature = "tiktoken"))]
fn without_tiktoken_every_model_is_estimated() {
    let p = ModelProfiles::new();
    let text = "I'm sure they'll say it's fine, don't you think?";
    // The estimate, for OpenAI models too: there is no vocabulary to count with.
    for model in ["gpt-4.1", "gpt-4", "mistral"] {
        assert_eq!(
            p.lookup(model).counter().unwrap().count_text(text),
            17,
            "{model}"
        );
        // A caller that needs exact counts can tell before relying on them.
        assert!(!p.lookup(model).counts_exactly(), "{model}");
    }
}

#[test]
fn every_builtin_profile_leaves_most_of_its_window_to_the_prompt() {
    for p in keel_token::builtin_profiles() {
        let budget = p.input_budget();
        assert!(
            budget * 4 >= p.context_window * 3 && budget > 0,
            "{}: budget {budget} of a {} window",
            p.name,
            p.context_window
        );
        assert!(p.reserved_output() <= p.max_output_tokens, "{}", p.name);
    }
}
