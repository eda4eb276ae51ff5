use std::sync::atomic::{AtomicU64, Ordering};

use keel_message::{Message, ToolSpec};

use crate::{Framing, TokenCounter, TokenError};

/// A counter whose counts are scaled by a factor learned from the usage the provider
/// reports.
///
/// After each model call, pass the count this counter estimated for the prompt and the
/// provider's `prompt_tokens` (or `input_tokens`) to [`observe`](Self::observe). The
/// factor moves toward `actual / raw estimate` by an exponential moving average
/// (weight [`smoothing`](Self::with_smoothing), 0.2 by default), up or down, and stays
/// within [`bounds`](Self::with_bounds) (0.25..=4.0 by default) so one bad report
/// cannot wreck it. Every count is the inner count times the factor, rounded to the
/// nearest integer; a whole prompt is scaled once, not message by message.
///
/// It is thread-safe: the factor is a lock-free atomic, so one calibrated counter can
/// be shared by every task that talks to the same model.
///
/// ```
/// use keel_token::{ApproxCounter, CalibratedCounter, TokenCounter};
///
/// let counter = CalibratedCounter::new(ApproxCounter::new().with_chars_per_token(4));
/// let text = "x".repeat(400);
/// assert_eq!(counter.count_text(&text), 100);
///
/// // The provider keeps reporting 20% more than we estimate.
/// for _ in 0..50 {
///     let estimate = counter.count_text(&text);
///     counter.observe(estimate, 120);
/// }
/// assert!((counter.factor() - 1.2).abs() < 0.01);
/// assert_eq!(counter.count_text(&text), 120);
/// ```
#[derive(Debug)]
pub struct CalibratedCounter<C> {
    inner: C,
    /// The factor, as `f64` bits.
    factor: AtomicU64,
    initial: f64,
    smoothing: f64,
    min: f64,
    max: f64,
    observations: AtomicU64,
}

impl<C: TokenCounter> CalibratedCounter<C> {
    /// Wraps `inner` with a factor of 1.
    pub fn new(inner: C) -> Self {
        CalibratedCounter {
            inner,
            factor: AtomicU64::new(1.0f64.to_bits()),
            initial: 1.0,
            smoothing: 0.2,
            min: 0.25,
            max: 4.0,
            observations: AtomicU64::new(0),
        }
    }

    /// Starts from `factor` instead of 1 (also the value [`reset`](Self::reset) returns
    /// to). It must be finite and within the bounds.
    ///
    /// ```
    /// use keel_token::{ApproxCounter, CalibratedCounter, TokenCounter};
    /// // Claude's tokenizer is known to give more tokens than chars / 4 suggests.
    /// let c = CalibratedCounter::new(ApproxCounter::new().with_chars_per_token(4)).with_factor(1.15)?;
    /// assert_eq!(c.count_text(&"x".repeat(400)), 115);
    /// # Ok::<(), keel_token::TokenError>(())
    /// ```
    pub fn with_factor(mut self, factor: f64) -> Result<Self, TokenError> {
        if !factor.is_finite() || factor < self.min || factor > self.max {
            return Err(TokenError::InvalidCalibration(format!(
                "factor {factor} is outside {}..={}",
                self.min, self.max
            )));
        }
        self.initial = factor;
        self.factor = AtomicU64::new(factor.to_bits());
        Ok(self)
    }

    /// The weight of each new observation, in `(0, 1]`: higher adapts faster.
    pub fn with_smoothing(mut self, smoothing: f64) -> Result<Self, TokenError> {
        if !(smoothing > 0.0 && smoothing <= 1.0) {
            return Err(TokenError::InvalidCalibration(format!(
                "smoothing {smoothing} is outside (0, 1]"
            )));
        }
        self.smoothing = smoothing;
        Ok(self)
    }

    /// The range the factor is kept in: `0 < min <= 1 <= max`, finite.
    ///
    /// ```
    /// use keel_token::{ApproxCounter, CalibratedCounter};
    /// let c = CalibratedCounter::new(ApproxCounter::new()).with_bounds(0.8, 1.25)?;
    /// c.observe(100, 1_000); // a wild report
    /// assert!(c.factor() <= 1.25);
    /// assert!(CalibratedCounter::new(ApproxCounter::new()).with_bounds(2.0, 1.0).is_err());
    /// # Ok::<(), keel_token::TokenError>(())
    /// ```
    pub fn with_bounds(mut self, min: f64, max: f64) -> Result<Self, TokenError> {
        if !(min.is_finite() && max.is_finite() && min > 0.0 && min <= 1.0 && max >= 1.0) {
            return Err(TokenError::InvalidCalibration(format!(
                "bounds {min}..={max} must satisfy 0 < min <= 1 <= max"
            )));
        }
        self.min = min;
        self.max = max;
        let clamped = self.factor().clamp(min, max);
        self.factor = AtomicU64::new(clamped.to_bits());
        self.initial = self.initial.clamp(min, max);
        Ok(self)
    }

    /// The current factor.
    pub fn factor(&self) -> f64 {
        f64::from_bits(self.factor.load(Ordering::Relaxed))
    }

    /// How many observations have moved the factor.
    pub fn observations(&self) -> u64 {
        self.observations.load(Ordering::Relaxed)
    }

    /// Learns from one model call: `estimated` is what this counter counted for the
    /// prompt (calibrated, as returned), `actual` what the provider reported.
    ///
    /// Observations with a zero on either side carry no information and are ignored.
    ///
    /// ```
    /// use keel_token::{ApproxCounter, CalibratedCounter};
    ///
    /// let c = CalibratedCounter::new(ApproxCounter::new());
    /// c.observe(100, 50); // we over-counted: the factor goes down
    /// assert!(c.factor() < 1.0);
    /// let low = c.factor();
    /// c.observe(100, 150); // now under-counted: it goes back up
    /// assert!(c.factor() > low);
    /// ```
    pub fn observe(&self, estimated: usize, actual: usize) {
        if estimated == 0 || actual == 0 {
            return;
        }
        let ratio = actual as f64 / estimated as f64;
        let mut current = self.factor.load(Ordering::Relaxed);
        loop {
            let f = f64::from_bits(current);
            // `estimated` was made with (about) the current factor, so the factor that
            // would have been exact is f * ratio.
            let target = f * ratio;
            let next = (f + self.smoothing * (target - f)).clamp(self.min, self.max);
            match self.factor.compare_exchange_weak(
                current,
                next.to_bits(),
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => break,
                Err(seen) => current = seen,
            }
        }
        self.observations.fetch_add(1, Ordering::Relaxed);
    }

    /// Forgets what was learned: back to the initial factor.
    pub fn reset(&self) {
        self.factor.store(self.initial.to_bits(), Ordering::Relaxed);
        self.observations.store(0, Ordering::Relaxed);
    }

    /// The wrapped counter (its counts are uncalibrated).
    pub fn inner(&self) -> &C {
        &self.inner
    }

    /// Unwraps the counter.
    pub fn into_inner(self) -> C {
        self.inner
    }

    fn scale(&self, n: usize) -> usize {
        let scaled = (n as f64 * self.factor()).round();
        // Saturates on overflow (`as` from f64 clamps), never panics.
        scaled as usize
    }
}

impl<C: TokenCounter> TokenCounter for CalibratedCounter<C> {
    fn count_text(&self, text: &str) -> usize {
        self.scale(self.inner.count_text(text))
    }

    /// The inner counter's bound, scaled as its counts are (scaling is monotone).
    fn max_tokens(&self, text: &str) -> Option<usize> {
        self.inner.max_tokens(text).map(|n| self.scale(n))
    }

    fn framing(&self) -> Framing {
        self.inner.framing()
    }

    fn count_message(&self, message: &Message) -> usize {
        self.scale(self.inner.count_message(message))
    }

    fn count_messages(&self, messages: &[Message]) -> usize {
        self.scale(self.inner.count_messages(messages))
    }

    fn count_tool(&self, tool: &ToolSpec) -> usize {
        self.scale(self.inner.count_tool(tool))
    }

    fn count_tools(&self, tools: &[ToolSpec]) -> usize {
        self.scale(self.inner.count_tools(tools))
    }

    fn count_prompt(&self, messages: &[Message], tools: &[ToolSpec]) -> usize {
        self.scale(self.inner.count_prompt(messages, tools))
    }
}
