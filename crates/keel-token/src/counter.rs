use std::sync::Arc;

use keel_message::{Content, ContentPart, Message, ToolCall, ToolSpec};

/// Fixed token costs a chat format adds around the text it carries.
///
/// The defaults ([`Framing::OPENAI`]) follow OpenAI's documented chat framing (the
/// "How to count tokens with tiktoken" cookbook): every message costs 3 tokens plus its
/// fields, a `name` costs 1 more, and every reply is primed with 3 tokens. What the
/// cookbook leaves open (tool calls, tool specs, images) is an allowance; wrap the
/// counter in a [`CalibratedCounter`](crate::CalibratedCounter) to correct the total
/// from what the provider reports.
///
/// ```
/// use keel_token::{ApproxCounter, Framing, TokenCounter};
/// use keel_message::Message;
///
/// let bare = ApproxCounter::new().with_framing(Framing::NONE);
/// // Only the text is counted: "user" (1 word, a quarter more: 2) + "hello there"
/// // (2 words, a quarter more: 3).
/// assert_eq!(bare.count_message(&Message::user("hello there")), 5);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Framing {
    /// Added for every message (`<|start|>{role}...<|end|>` around the content).
    pub per_message: usize,
    /// Added when a message has a `name`.
    pub per_name: usize,
    /// Added once per prompt: the reply is primed with `<|start|>assistant<|message|>`.
    pub reply_priming: usize,
    /// Added for every tool call, on top of its name and JSON arguments.
    pub per_tool_call: usize,
    /// Added for every tool spec, on top of its JSON.
    pub per_tool_spec: usize,
    /// Counted for every image part (OpenAI's base cost of a low-detail image).
    pub per_image: usize,
}

impl Framing {
    /// OpenAI chat framing: 3 per message, +1 per name, 3 to prime the reply; tool
    /// calls cost their name and JSON arguments only, each tool spec its JSON plus 8,
    /// each image 85.
    pub const OPENAI: Framing = Framing {
        per_message: 3,
        per_name: 1,
        reply_priming: 3,
        per_tool_call: 0,
        per_tool_spec: 8,
        per_image: 85,
    };

    /// No overhead at all: only text is counted.
    pub const NONE: Framing = Framing {
        per_message: 0,
        per_name: 0,
        reply_priming: 0,
        per_tool_call: 0,
        per_tool_spec: 0,
        per_image: 0,
    };
}

impl Default for Framing {
    fn default() -> Self {
        Framing::OPENAI
    }
}

/// Counts the tokens of text, messages and whole prompts.
///
/// An implementor writes [`count_text`](TokenCounter::count_text); every other method has
/// a default built on it and on [`framing`](TokenCounter::framing):
///
/// * a message costs `per_message` + its role + its text + (its name + `per_name`) +
///   for each tool call its name + its JSON arguments + `per_tool_call` + the
///   `tool_call_id` it answers, if any (every string field of the wire message, as the
///   OpenAI cookbook counts). Images cost `per_image`; other non-text parts their JSON.
/// * a list of messages costs the sum plus `reply_priming`;
/// * a tool spec costs its JSON (`{"name", "description", "parameters"}`) plus
///   `per_tool_spec`;
/// * a prompt is its messages plus its tools.
///
/// Counting never fails and never panics, whatever the input.
///
/// ```
/// use keel_token::TokenCounter;
/// use keel_message::Message;
///
/// /// One token per whitespace-separated word.
/// struct Words;
///
/// impl TokenCounter for Words {
///     fn count_text(&self, text: &str) -> usize {
///         text.split_whitespace().count()
///     }
/// }
///
/// let history = [Message::system("be brief"), Message::user("hi there").with_name("ann")];
/// // system: 3 + 1 ("system") + 2; user: 3 + 1 ("user") + 2 + (1 + 1 for the name);
/// // reply priming: 3.
/// assert_eq!(Words.count_messages(&history), 6 + 8 + 3);
/// ```
pub trait TokenCounter: Send + Sync {
    /// The number of tokens of `text` alone, without any framing.
    fn count_text(&self, text: &str) -> usize;

    /// A bound that `count_text(text)` never exceeds, when the counter knows one that
    /// costs far less than counting (`None`, the default, when it does not). Callers
    /// that only ask whether a text is under a limit use it to skip counting the
    /// texts that cannot be over it.
    ///
    /// A byte-level BPE gives every token at least one byte, so [`crate::TiktokenCounter`]
    /// answers the text's length in bytes:
    ///
    /// ```
    /// # #[cfg(feature = "tiktoken")] {
    /// use keel_token::{TiktokenCounter, TokenCounter};
    ///
    /// let counter = TiktokenCounter::o200k_base().unwrap();
    /// let text = "a tool result of a few words";
    /// let bound = counter.max_tokens(text).unwrap();
    /// assert_eq!(bound, text.len());
    /// assert!(counter.count_text(text) <= bound);
    /// # }
    /// ```
    fn max_tokens(&self, text: &str) -> Option<usize> {
        let _ = text;
        None
    }

    /// The chat framing this counter adds; [`Framing::OPENAI`] unless overridden.
    fn framing(&self) -> Framing {
        Framing::OPENAI
    }

    /// The tokens of one message, framing included (see the trait docs).
    fn count_message(&self, message: &Message) -> usize {
        let f = self.framing();
        let mut n = f.per_message + self.count_text(message.role.as_str());
        n += count_content(self, &message.content);
        if let Some(name) = &message.name {
            n += self.count_text(name) + f.per_name;
        }
        n += message
            .tool_calls
            .iter()
            .map(|call| count_tool_call(self, call) + f.per_tool_call)
            .sum::<usize>();
        if let Some(id) = &message.tool_call_id {
            n += self.count_text(id);
        }
        n
    }

    /// The tokens of a list of messages sent as one prompt: each message, plus the
    /// reply priming.
    fn count_messages(&self, messages: &[Message]) -> usize {
        messages
            .iter()
            .map(|m| self.count_message(m))
            .sum::<usize>()
            + self.framing().reply_priming
    }

    /// The tokens of one tool spec: its JSON plus `per_tool_spec`.
    fn count_tool(&self, tool: &ToolSpec) -> usize {
        let json = serde_json::json!({
            "name": tool.name,
            "description": tool.description,
            "parameters": tool.parameters,
        });
        self.count_text(&json.to_string()) + self.framing().per_tool_spec
    }

    /// The tokens of a list of tool specs.
    fn count_tools(&self, tools: &[ToolSpec]) -> usize {
        tools.iter().map(|t| self.count_tool(t)).sum()
    }

    /// The tokens of a whole prompt: the messages (with reply priming) and the tools
    /// offered with them.
    fn count_prompt(&self, messages: &[Message], tools: &[ToolSpec]) -> usize {
        self.count_messages(messages) + self.count_tools(tools)
    }
}

fn count_content<C: TokenCounter + ?Sized>(counter: &C, content: &Content) -> usize {
    match content {
        Content::Text(text) => counter.count_text(text),
        Content::Parts(parts) => {
            let mut n = counter.count_text(&content.text());
            for part in parts {
                match part {
                    ContentPart::Image { .. } => n += counter.framing().per_image,
                    ContentPart::Other(value) if part.as_text().is_none() => {
                        n += counter.count_text(&value.to_string());
                    }
                    _ => {}
                }
            }
            n
        }
    }
}

fn count_tool_call<C: TokenCounter + ?Sized>(counter: &C, call: &ToolCall) -> usize {
    counter.count_text(&call.name) + counter.count_text(&call.arguments.to_json_string())
}

macro_rules! forward {
    ($($ptr:ty),*) => {$(
        impl<T: TokenCounter + ?Sized> TokenCounter for $ptr {
            fn count_text(&self, text: &str) -> usize {
                (**self).count_text(text)
            }
            fn max_tokens(&self, text: &str) -> Option<usize> {
                (**self).max_tokens(text)
            }
            fn framing(&self) -> Framing {
                (**self).framing()
            }
            fn count_message(&self, message: &Message) -> usize {
                (**self).count_message(message)
            }
            fn count_messages(&self, messages: &[Message]) -> usize {
                (**self).count_messages(messages)
            }
            fn count_tool(&self, tool: &ToolSpec) -> usize {
                (**self).count_tool(tool)
            }
            fn count_tools(&self, tools: &[ToolSpec]) -> usize {
                (**self).count_tools(tools)
            }
            fn count_prompt(&self, messages: &[Message], tools: &[ToolSpec]) -> usize {
                (**self).count_prompt(messages, tools)
            }
        }
    )*};
}

forward!(&T, Box<T>, Arc<T>);
