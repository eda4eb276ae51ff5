//! `#[derive(State)]`: a struct of reducer-annotated fields becomes a keel graph state.
//!
//! A keel graph state is a struct whose fields are *channels*. Each channel has a
//! reducer (a `keel_graph::reducer::Reducer`) that folds the writes nodes make to it in
//! one superstep into its value. This derive writes the `keel_graph::State` impl for
//! such a struct, plus the *update* type nodes return: the same fields, each an optional
//! write of that channel's reducer update type.
//!
//! Use it through `keel_graph`, which re-exports it as `keel_graph::State`. The
//! generated code names `::keel_graph`, so by default the crate must be a dependency
//! under that name. Through the facade crate `keel`, `keel::graph::State` is the same
//! derive with `::keel::graph` as its default, so a crate that depends on `keel` alone
//! needs nothing more. Under a renamed dependency, or a re-export of your own, say where
//! keel-graph is with `#[state(crate = "path")]` (see [Attributes](#attributes)). See
//! `keel_graph`'s documentation for running graphs; this page is the reference for the
//! attributes and the generated API.
//!
//! ```ignore
//! use std::collections::VecDeque;
//!
//! use keel_graph::State;
//! use keel_graph::reducer::{AddMessages, KeepLast, Messages, Sum};
//!
//! #[derive(Clone, State)]
//! pub struct Chat {
//!     /// The conversation.
//!     #[reducer(AddMessages)]
//!     pub messages: Messages,
//!     /// No attribute: `LastValue<String>`, one write per superstep.
//!     pub mood: String,
//!     #[reducer(KeepLast<String>, with = KeepLast::new(5))]
//!     pub recent: VecDeque<String>,
//!     #[reducer(Sum<u64>)]
//!     pub tokens: u64,
//! }
//!
//! // A node returns a partial update; unset channels are left alone.
//! let update = ChatUpdate::default().mood("curious".into()).tokens(12);
//! let command: keel_graph::Command<Chat> = update.into();
//! ```
//!
//! # Attributes
//!
//! On a field (at most one):
//!
//! - `#[reducer(Type)]`: the channel's reducer, built with `<Type as Default>::default()`.
//! - `#[reducer(Type, with = expr)]`: the reducer, built by evaluating `expr` (in the
//!   struct's module), e.g. `#[reducer(KeepLast<String>, with = KeepLast::new(5))]`.
//! - none: `keel_graph::reducer::LastValue<FieldType>` (a channel that takes at most one
//!   write per superstep).
//!
//! The field's type must be the reducer's `Value` (for example `VecDeque<T>` for
//! `KeepLast<T>`, `Option<T>` for `Max<T>`); otherwise the derive fails to compile with
//! a type mismatch at the field's type.
//!
//! On the struct, in one `#[state(..)]` or several:
//!
//! - `#[state(update = Name)]` names the update type (default: the struct's name
//!   followed by `Update`).
//! - `#[state(crate = "path")]` is the path at which keel-graph is reachable from the
//!   struct's module, used for every keel-graph item in the generated code (default:
//!   `::keel_graph`; `::keel::graph` for the facade's `keel::graph::State`), like
//!   serde's `#[serde(crate = "..")]`. The path is a string literal or written bare
//!   (`#[state(crate = my_deps::graph)]`); it is a module path (no generic arguments),
//!   relative paths such as `crate::deps::graph` work. Under a renamed dependency:
//!
//! ```ignore
//! // Cargo.toml: graph = { package = "keel-graph", .. }
//! use graph::State;
//! use graph::reducer::{AddMessages, Messages};
//!
//! #[derive(Clone, State)]
//! #[state(crate = "graph")]
//! struct Chat {
//!     #[reducer(AddMessages)]
//!     messages: Messages,
//! }
//! ```
//!
//! The struct must have named fields and no generic parameters. Each field's reducer
//! update type must implement serde's `Serialize` and `DeserializeOwned`, and so must the
//! field's type (channels are checkpointed as JSON). The struct must be `Clone`, and so
//! must each field's type (as `#[derive(Clone)]` needs): the generated
//! `clone_channel_from` copies one channel, `swap_channel` swaps one.
//!
//! # Generated API
//!
//! For `struct Chat { .. }`, with the struct's visibility:
//!
//! - `struct ChatUpdate`: one public-as-the-struct field per channel,
//!   `Option<<R as Reducer>::Update>`, plus `Default` and a `Debug` impl that lists the
//!   channels written (each shown with its `Debug` if its update type has one, `..`
//!   otherwise; no `Debug` bound is needed).
//! - A chainable setter per channel, named like the field:
//!   `pub fn mood(self, update: <R as Reducer>::Update) -> ChatUpdate`. (A field named
//!   `default` gets a setter that shadows `Default::default` in `ChatUpdate::default()`
//!   calls; write `<ChatUpdate as Default>::default()` then.)
//! - `impl keel_graph::State for Chat`: `CHANNELS` lists the channel names (fields
//!   without any `r#`) in declaration order, and channel `i` is the `i`-th field.
//!   `decode_update` given several values for one channel keeps the last.
//! - `impl From<ChatUpdate> for keel_graph::Command<Chat>`, so a node can return
//!   `update.into()`.
//! - Private associated functions `__keel_reducer_<i>` and `__keel_reduce_<i>` on the
//!   struct (hidden; they build each reducer and run it).
//!
//! # Errors
//!
//! Every problem is reported as a compile error at the offending tokens, all at once:
//! an enum, tuple struct, unit struct or union (a state is a struct with named
//! fields); a generic struct; `#[reducer]` without its type, or with an option other
//! than `with = expr`; a `crate = ..` that is not a path; an option on the wrong item.
//! A field whose type is not its reducer's `Value` is a type mismatch at the field's
//! type.
//!
//! ```ignore
//! #[derive(Clone, State)]
//! struct Counter {
//!     #[reducer(Sum<u32>, init = 3)] // error: unknown `reducer` option `init`; the only one is `with = expr`
//!     total: u32,
//! }
//! ```
//!
//! Each of these errors, with its exact text, is a UI test in keel-graph
//! (`crates/keel-graph/tests/ui/*.rs` and `.stderr`, run by `tests/ui.rs` with
//! trybuild), where the derive and keel-graph are both in scope, so a case fails only
//! for the reason its `.stderr` gives.

mod expand;
mod parse;

use proc_macro::TokenStream;

/// Derives `keel_graph::State` for a struct with named fields, together with its update
/// type `<Name>Update` and `From<<Name>Update> for Command<Name>`.
///
/// Fields take `#[reducer(Type)]` or `#[reducer(Type, with = expr)]` (default:
/// `LastValue<FieldType>`); the struct takes `#[state(update = Name)]` and
/// `#[state(crate = "path::to::keel_graph")]` (when keel-graph is not a direct
/// dependency named `keel_graph`; through the facade, `keel::graph::State` already
/// defaults to `keel::graph`). See the
/// [crate documentation](crate) for the generated API.
#[proc_macro_derive(State, attributes(reducer, state))]
pub fn derive_state(input: TokenStream) -> TokenStream {
    derive(input, syn::parse_quote!(::keel_graph))
}

/// The same derive as [`State`](derive@State), whose generated code names
/// `::keel::graph` unless the struct says otherwise: the `keel` facade crate re-exports
/// it as `keel::graph::State`, so a crate that depends on the facade alone needs no
/// `#[state(crate = ..)]`. Use it through the facade, under that name.
#[proc_macro_derive(FacadeState, attributes(reducer, state))]
pub fn derive_facade_state(input: TokenStream) -> TokenStream {
    derive(input, syn::parse_quote!(::keel::graph))
}

fn derive(input: TokenStream, default_crate: syn::Path) -> TokenStream {
    let input = syn::parse_macro_input!(input as syn::DeriveInput);
    match parse::parse(&input, default_crate) {
        Ok(def) => expand::expand(&def).into(),
        Err(e) => e.to_compile_error().into(),
    }
}
