//! One retry policy for every layer that retries: graph nodes (keel-graph), model calls
//! (keel-model's providers and its `Retrying` wrapper) and summaries (keel-compaction).
//!
//! It lives here, in the crate every other keel crate already depends on, so the three
//! share one type, one meaning of "attempts" and one jitter, without a dependency
//! between them.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::time::Duration;

/// How a failed operation is retried: up to [`max_attempts`](Self::max_attempts) tries
/// in all, waiting `initial_backoff * multiplier^n` (at most `max_backoff`) after
/// failed attempt `n + 1`, with jitter a uniformly random time between half that wait
/// and all of it.
///
/// The same type (and defaults) configures a graph node's retries
/// (`keel_graph::NodeOptions::retry`), a model client's (`keel_model::HttpConfig::retry`
/// and the `keel_model::Retrying` wrapper) and the compactor's summary retries.
///
/// Every method is total: a policy with settings out of range still computes a wait
/// (`multiplier` below 1, NaN or infinite is taken as 1; a wait too long for a
/// `Duration` is `max_backoff`), and [`validate`](Self::validate) says what is wrong
/// for the layers that refuse such a policy up front.
///
/// ```
/// use std::time::Duration;
/// use keel_message::RetryPolicy;
///
/// let p = RetryPolicy::default(); // 3 attempts, 500 ms, x2, at most 30 s, jitter
/// assert_eq!(p.retries(), 2);
/// assert_eq!(p.backoff(0), Duration::from_millis(500));
/// assert_eq!(p.backoff(2), Duration::from_secs(2));
/// assert_eq!(p.backoff(20), Duration::from_secs(30)); // capped
///
/// // With jitter the wait is between half the backoff and all of it.
/// let wait = p.delay(1);
/// assert!(wait >= Duration::from_millis(500) && wait <= Duration::from_secs(1));
///
/// let patient = RetryPolicy::default()
///     .max_attempts(6)
///     .initial_backoff(Duration::from_millis(200))
///     .multiplier(3.0)
///     .max_backoff(Duration::from_secs(10))
///     .jitter(false);
/// assert_eq!(patient.delay(2), Duration::from_millis(1800));
/// assert!(RetryPolicy::none().validate().is_ok());
/// assert!(RetryPolicy::default().max_attempts(0).validate().is_err());
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct RetryPolicy {
    /// Attempts in all, the first included (default 3; 1 never retries).
    pub max_attempts: u32,
    /// Wait after the first failed attempt (default 500 ms).
    pub initial_backoff: Duration,
    /// Factor applied to the wait after each further failed attempt (default 2).
    pub multiplier: f64,
    /// The longest wait (default 30 s).
    pub max_backoff: Duration,
    /// Randomize each wait between half and all of it, so many clients failing at once
    /// do not retry in lockstep (default true).
    pub jitter: bool,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 3,
            initial_backoff: Duration::from_millis(500),
            multiplier: 2.0,
            max_backoff: Duration::from_secs(30),
            jitter: true,
        }
    }
}

/// A [`RetryPolicy`] setting out of range, from [`RetryPolicy::validate`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("retry policy: `{setting}` {reason}")]
#[non_exhaustive]
pub struct RetryPolicyError {
    /// The field of [`RetryPolicy`] that is out of range.
    pub setting: &'static str,
    /// Why, as a sentence fragment.
    pub reason: String,
}

impl RetryPolicy {
    /// The default policy (see [`RetryPolicy`]).
    pub fn new() -> Self {
        Self::default()
    }

    /// One attempt, no retry.
    pub fn none() -> Self {
        RetryPolicy {
            max_attempts: 1,
            ..Self::default()
        }
    }

    /// Sets [`max_attempts`](Self::max_attempts): attempts in all, the first included.
    #[must_use]
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts;
        self
    }

    /// Sets [`initial_backoff`](Self::initial_backoff).
    #[must_use]
    pub fn initial_backoff(mut self, wait: Duration) -> Self {
        self.initial_backoff = wait;
        self
    }

    /// Sets [`multiplier`](Self::multiplier).
    #[must_use]
    pub fn multiplier(mut self, factor: f64) -> Self {
        self.multiplier = factor;
        self
    }

    /// Sets [`max_backoff`](Self::max_backoff).
    #[must_use]
    pub fn max_backoff(mut self, wait: Duration) -> Self {
        self.max_backoff = wait;
        self
    }

    /// Sets [`jitter`](Self::jitter).
    #[must_use]
    pub fn jitter(mut self, on: bool) -> Self {
        self.jitter = on;
        self
    }

    /// Retries after the first attempt: `max_attempts - 1` (0 for a policy of 0
    /// attempts, which the layers that validate refuse).
    pub fn retries(&self) -> u32 {
        self.max_attempts.saturating_sub(1)
    }

    /// Whether another attempt may follow `failed` failed attempts.
    pub fn allows_retry(&self, failed: u32) -> bool {
        failed < self.max_attempts
    }

    /// The wait after failed attempt `retry + 1`, without jitter:
    /// `initial_backoff * multiplier^retry`, at most `max_backoff`.
    pub fn backoff(&self, retry: u32) -> Duration {
        let multiplier = if self.multiplier.is_finite() {
            self.multiplier.max(1.0)
        } else {
            1.0
        };
        let factor = multiplier.powi(i32::try_from(retry.min(1_024)).unwrap_or(1_024));
        let secs = self.initial_backoff.as_secs_f64() * factor;
        Duration::try_from_secs_f64(secs).map_or(self.max_backoff, |d| d.min(self.max_backoff))
    }

    /// The wait after failed attempt `retry + 1`: the [`backoff`](Self::backoff), with
    /// jitter when it is on.
    pub fn delay(&self, retry: u32) -> Duration {
        self.delay_with(retry, random_unit())
    }

    /// As [`delay`](Self::delay), with the jitter drawn from `unit` (a number in
    /// `[0, 1]`; values outside are clamped): the wait is
    /// `backoff * (0.5 + 0.5 * unit)`. For deterministic tests.
    pub fn delay_with(&self, retry: u32, unit: f64) -> Duration {
        let base = self.backoff(retry);
        if !self.jitter {
            return base;
        }
        let unit = if unit.is_nan() {
            1.0
        } else {
            unit.clamp(0.0, 1.0)
        };
        Duration::try_from_secs_f64(base.as_secs_f64() * (0.5 + 0.5 * unit))
            .map_or(base, |d| d.min(base))
    }

    /// The first setting out of range: `max_attempts` 0, or a `multiplier` that is not
    /// a finite number of at least 1.
    pub fn validate(&self) -> Result<(), RetryPolicyError> {
        if self.max_attempts == 0 {
            return Err(RetryPolicyError {
                setting: "max_attempts",
                reason: "is 0; it counts the first attempt, so it must be at least 1".to_owned(),
            });
        }
        if !self.multiplier.is_finite() || self.multiplier < 1.0 {
            return Err(RetryPolicyError {
                setting: "multiplier",
                reason: format!(
                    "is {}; it must be a finite number of at least 1 (1 waits the same each time)",
                    self.multiplier
                ),
            });
        }
        Ok(())
    }
}

/// A random number in `[0, 1)`, from the standard library's randomly keyed hasher
/// (fresh keys per call): enough to spread retries, not for cryptography.
fn random_unit() -> f64 {
    let mut h = RandomState::new().build_hasher();
    h.write_u64(0x9e37_79b9_7f4a_7c15);
    (h.finish() >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_and_caps_and_is_total() {
        let p = RetryPolicy::default().jitter(false);
        assert_eq!(p.delay(0), Duration::from_millis(500));
        assert_eq!(p.delay(1), Duration::from_secs(1));
        assert_eq!(p.delay(u32::MAX), Duration::from_secs(30));
        for m in [f64::NAN, f64::INFINITY, -3.0, 0.0, 1e300] {
            let d = p.clone().multiplier(m).backoff(50);
            assert!(d <= Duration::from_secs(30), "{m}: {d:?}");
        }
        let huge = RetryPolicy::default()
            .initial_backoff(Duration::MAX)
            .max_backoff(Duration::MAX);
        assert_eq!(huge.backoff(3), Duration::MAX);
    }

    #[test]
    fn jitter_stays_between_half_and_all_of_the_backoff() {
        let p = RetryPolicy::default();
        assert_eq!(p.delay_with(1, 0.0), Duration::from_millis(500));
        assert_eq!(p.delay_with(1, 1.0), Duration::from_secs(1));
        assert_eq!(p.delay_with(1, f64::NAN), Duration::from_secs(1));
        assert_eq!(p.delay_with(1, -5.0), Duration::from_millis(500));
        for _ in 0..200 {
            let u = random_unit();
            assert!((0.0..1.0).contains(&u));
            let d = p.delay(1);
            assert!(d >= Duration::from_millis(500) && d <= Duration::from_secs(1));
        }
    }

    #[test]
    fn attempts_count_the_first_one() {
        let p = RetryPolicy::default().max_attempts(3);
        assert_eq!(p.retries(), 2);
        assert!(p.allows_retry(1) && p.allows_retry(2) && !p.allows_retry(3));
        assert!(!RetryPolicy::none().allows_retry(1));
        assert_eq!(RetryPolicy::default().max_attempts(0).retries(), 0);
    }

    #[test]
    fn validate_names_the_setting() {
        let e = RetryPolicy::default().max_attempts(0).validate().err();
        assert_eq!(e.map(|e| e.setting), Some("max_attempts"));
        let e = RetryPolicy::default().multiplier(0.5).validate().err();
        assert_eq!(e.map(|e| e.setting), Some("multiplier"));
        assert!(RetryPolicy::default().validate().is_ok());
    }
}
