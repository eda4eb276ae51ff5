use std::fmt;

/// How a model's text becomes tokens.
///
/// ```
/// use keel_token::Encoding;
///
/// assert_eq!(Encoding::O200kBase.name(), "o200k_base");
/// assert!(Encoding::Cl100kBase.is_bpe());
/// assert!(!Encoding::Approximate.is_bpe());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Encoding {
    /// OpenAI's `o200k_base`: GPT-4o, GPT-4.1, o1/o3/o4, GPT-5.
    O200kBase,
    /// OpenAI's `cl100k_base`: GPT-4, GPT-3.5-turbo, text-embedding-3.
    Cl100kBase,
    /// No known vocabulary: estimate from the character count
    /// ([`ApproxCounter`](crate::ApproxCounter)).
    Approximate,
}

impl Encoding {
    /// The encoding's name, as tiktoken spells it (`approximate` for
    /// [`Encoding::Approximate`]).
    pub fn name(self) -> &'static str {
        match self {
            Encoding::O200kBase => "o200k_base",
            Encoding::Cl100kBase => "cl100k_base",
            Encoding::Approximate => "approximate",
        }
    }

    /// True for the BPE encodings [`TiktokenCounter`](crate::TiktokenCounter) counts
    /// exactly.
    pub fn is_bpe(self) -> bool {
        matches!(self, Encoding::O200kBase | Encoding::Cl100kBase)
    }
}

impl fmt::Display for Encoding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
