#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! CalibratedCounter: the factor follows provider-reported usage up and down.

use std::sync::Arc;

use keel_message::Message;
use keel_token::{ApproxCounter, CalibratedCounter, Framing, TokenCounter, TokenError};

fn counter() -> CalibratedCounter<ApproxCounter> {
    // Four characters a token, so the arithmetic below reads plainly.
    CalibratedCounter::new(
        ApproxCounter::new()
            .with_chars_per_token(4)
            .with_framing(Framing::NONE),
    )
}

/// Runs `rounds` model calls whose real cost is `truth_ratio` times our raw estimate.
fn feed(c: &CalibratedCounter<ApproxCounter>, text: &str, truth_ratio: f64, rounds: usize) {
    for _ in 0..rounds {
        let estimate = c.count_text(text);
        let raw = c.inner().count_text(text);
        c.observe(estimate, (raw as f64 * truth_ratio).round() as usize);
    }
}

#[test]
fn moves_up_then_down_then_up() {
    let c = counter();
    let text = "x".repeat(4000); // 1000 raw tokens
    assert_eq!(c.count_text(&text), 1000);

    feed(&c, &text, 1.3, 60);
    assert!((c.factor() - 1.3).abs() < 0.01, "{}", c.factor());
    assert_eq!(c.count_text(&text), 1300);

    feed(&c, &text, 0.8, 60);
    assert!((c.factor() - 0.8).abs() < 0.01, "{}", c.factor());
    assert_eq!(c.count_text(&text), 800);

    feed(&c, &text, 1.05, 80);
    assert!((c.factor() - 1.05).abs() < 0.01, "{}", c.factor());
    assert_eq!(c.observations(), 200);
}

#[test]
fn one_observation_moves_by_the_smoothing_weight() {
    let c = counter().with_smoothing(0.5).unwrap();
    c.observe(100, 200); // exact factor would be 2.0; halfway there
    assert!((c.factor() - 1.5).abs() < 1e-12);
    c.observe(150, 75); // exact would be 1.5 * 0.5 = 0.75; halfway from 1.5
    assert!((c.factor() - 1.125).abs() < 1e-12);
}

#[test]
fn clamped_to_bounds_and_zeros_ignored() {
    let c = counter();
    for _ in 0..100 {
        c.observe(10, 10_000);
    }
    assert_eq!(c.factor(), 4.0);
    for _ in 0..100 {
        c.observe(10_000, 1);
    }
    assert_eq!(c.factor(), 0.25);
    let before = c.observations();
    c.observe(0, 100);
    c.observe(100, 0);
    assert_eq!((c.factor(), c.observations()), (0.25, before));
    c.reset();
    assert_eq!((c.factor(), c.observations()), (1.0, 0));
}

#[test]
fn invalid_settings_are_errors() {
    let bad = |r: Result<CalibratedCounter<ApproxCounter>, TokenError>| {
        assert!(matches!(r, Err(TokenError::InvalidCalibration(_))))
    };
    bad(counter().with_smoothing(0.0));
    bad(counter().with_smoothing(1.5));
    bad(counter().with_smoothing(f64::NAN));
    bad(counter().with_bounds(1.5, 2.0));
    bad(counter().with_bounds(0.0, 2.0));
    bad(counter().with_bounds(0.5, f64::INFINITY));
    bad(counter().with_factor(10.0));
    bad(counter().with_factor(f64::NAN));
    let ok = counter().with_factor(1.2).unwrap();
    ok.observe(120, 60);
    ok.reset();
    assert_eq!(ok.factor(), 1.2);
}

#[test]
fn scales_whole_prompts_once() {
    let c = CalibratedCounter::new(ApproxCounter::new())
        .with_factor(1.5)
        .unwrap();
    let history = [Message::user("abcdefgh"), Message::assistant("ijkl")];
    let raw = c.inner().count_messages(&history);
    assert_eq!(
        c.count_messages(&history),
        (raw as f64 * 1.5).round() as usize
    );
    assert_eq!(
        c.count_prompt(&history, &[]),
        (raw as f64 * 1.5).round() as usize
    );
    assert_eq!(c.framing(), Framing::OPENAI);
}

#[test]
fn thread_safe_under_concurrent_observations() {
    let c = Arc::new(counter());
    let handles: Vec<_> = (0..4)
        .map(|_| {
            let c = Arc::clone(&c);
            std::thread::spawn(move || {
                for _ in 0..500 {
                    let e = c.count_text(&"x".repeat(400));
                    c.observe(e, 200);
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    assert_eq!(c.observations(), 2000);
    assert!((c.factor() - 2.0).abs() < 0.02, "{}", c.factor());
}
