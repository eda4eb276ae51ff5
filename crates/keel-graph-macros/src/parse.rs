//! Reads a `#[derive(State)]` input into a [`StateDef`], reporting every problem found
//! (each at its own span) rather than stopping at the first.

use quote::format_ident;
use syn::ext::IdentExt;
use syn::parse::ParseStream;
use syn::spanned::Spanned;
use syn::{
    Attribute, Data, DeriveInput, Expr, Fields, Ident, LitStr, Path, Token, Type, Visibility,
};

/// A state struct, validated.
pub(crate) struct StateDef {
    /// The struct's visibility (also given to the update type and its fields).
    pub vis: Visibility,
    /// The struct's name.
    pub name: Ident,
    /// The update type's name: `#[state(update = ..)]` or `<name>Update`.
    pub update: Ident,
    /// The path of keel-graph in generated code: `#[state(crate = ..)]` or
    /// `::keel_graph`.
    pub krate: Path,
    /// The channels, in declaration order.
    pub channels: Vec<Channel>,
}

/// One field of the state struct.
pub(crate) struct Channel {
    /// The field (possibly a raw identifier such as `r#type`).
    pub field: Ident,
    /// The channel name: the field without any `r#`.
    pub name: String,
    /// The field's type, which must be the reducer's `Value`.
    pub ty: Type,
    /// The field's doc attributes, repeated on the update field.
    pub docs: Vec<Attribute>,
    /// The reducer type.
    pub reducer: Type,
    /// How to build the reducer: `with = expr`, or `None` for `Default::default()`.
    pub with: Option<Expr>,
}

/// Collects errors so that one expansion reports all of them.
#[derive(Default)]
struct Errors(Option<syn::Error>);

impl Errors {
    fn push(&mut self, e: syn::Error) {
        match &mut self.0 {
            Some(all) => all.combine(e),
            None => self.0 = Some(e),
        }
    }

    fn finish(self) -> syn::Result<()> {
        self.0.map_or(Ok(()), Err)
    }
}

/// Validates a derive input; `default_crate` is the path of keel-graph when the struct
/// names none (`#[state(crate = ..)]`).
pub(crate) fn parse(input: &DeriveInput, default_crate: Path) -> syn::Result<StateDef> {
    let mut errors = Errors::default();

    let fields = match &input.data {
        Data::Struct(s) => match &s.fields {
            Fields::Named(named) => Some(named),
            Fields::Unnamed(f) => {
                errors.push(syn::Error::new(
                    f.span(),
                    "`#[derive(State)]` needs a struct with named fields (each field is a \
                     channel), not a tuple struct",
                ));
                None
            }
            Fields::Unit => {
                errors.push(syn::Error::new(
                    input.ident.span(),
                    "`#[derive(State)]` needs a struct with named fields (each field is a \
                     channel), not a unit struct; use `struct Name {}` for a state without \
                     channels",
                ));
                None
            }
        },
        Data::Enum(e) => {
            errors.push(syn::Error::new(
                e.enum_token.span,
                "`#[derive(State)]` needs a struct with named fields (each field is a \
                 channel), not an enum",
            ));
            None
        }
        Data::Union(u) => {
            errors.push(syn::Error::new(
                u.union_token.span,
                "`#[derive(State)]` needs a struct with named fields (each field is a \
                 channel), not a union",
            ));
            None
        }
    };

    if !input.generics.params.is_empty() || input.generics.where_clause.is_some() {
        let span = if input.generics.params.is_empty() {
            input.generics.where_clause.span()
        } else {
            input.generics.params.span()
        };
        errors.push(syn::Error::new(
            span,
            "`#[derive(State)]` does not support generic structs: a state is a concrete \
             schema; write the field types out (a type alias works)",
        ));
    }

    let mut options = StateOptions::default();
    for attr in &input.attrs {
        if attr.path().is_ident("reducer") {
            errors.push(syn::Error::new(
                attr.span(),
                "`#[reducer(..)]` goes on a field, not on the struct",
            ));
        } else if attr.path().is_ident("state")
            && let Err(e) = parse_state_attr(attr, &mut options)
        {
            errors.push(e);
        }
    }
    let krate = options.krate.unwrap_or(default_crate);

    let mut channels = Vec::new();
    for field in fields.into_iter().flat_map(|f| &f.named) {
        let Some(ident) = &field.ident else {
            continue;
        };
        let mut reducer_attr: Option<(Type, Option<Expr>)> = None;
        let mut docs = Vec::new();
        for attr in &field.attrs {
            if attr.path().is_ident("doc") {
                docs.push(attr.clone());
            } else if attr.path().is_ident("state") {
                errors.push(syn::Error::new(
                    attr.span(),
                    "`#[state(..)]` goes on the struct; a field takes `#[reducer(Type)]` or \
                     `#[reducer(Type, with = expr)]`",
                ));
            } else if attr.path().is_ident("reducer") {
                if reducer_attr.is_some() {
                    errors.push(syn::Error::new(
                        attr.span(),
                        "a field takes one `#[reducer(..)]` attribute",
                    ));
                    continue;
                }
                if matches!(attr.meta, syn::Meta::Path(_)) {
                    errors.push(syn::Error::new(attr.meta.span(), EXPECTED_REDUCER));
                    continue;
                }
                match attr.parse_args_with(parse_reducer_args) {
                    Ok(parsed) => reducer_attr = Some(parsed),
                    Err(e) => errors.push(e),
                }
            }
        }
        let ty = field.ty.clone();
        let (reducer, with) = reducer_attr.unwrap_or_else(|| {
            let span = ty.span();
            let default: Type = syn::parse_quote_spanned! {span=>
                #krate::reducer::LastValue<#ty>
            };
            (default, None)
        });
        channels.push(Channel {
            field: ident.clone(),
            name: ident.unraw().to_string(),
            ty,
            docs,
            reducer,
            with,
        });
    }

    errors.finish()?;
    let name = input.ident.clone();
    let update = options
        .update
        .unwrap_or_else(|| format_ident!("{}Update", name.unraw(), span = name.span()));
    Ok(StateDef {
        vis: input.vis.clone(),
        name,
        update,
        krate,
        channels,
    })
}

/// The options of `#[state(..)]` on the struct.
#[derive(Default)]
struct StateOptions {
    /// `update = Name`.
    update: Option<Ident>,
    /// `crate = "path"` or `crate = path`.
    krate: Option<Path>,
}

/// `#[state(update = Name)]`, `#[state(crate = "path")]`, `#[state(crate = path)]`, or
/// both options in one attribute.
fn parse_state_attr(attr: &Attribute, options: &mut StateOptions) -> syn::Result<()> {
    attr.parse_nested_meta(|meta| {
        if meta.path.is_ident("update") {
            let name: Ident = meta.value()?.parse()?;
            if options.update.is_some() {
                return Err(syn::Error::new(
                    meta.path.span(),
                    "`update` is given more than once",
                ));
            }
            options.update = Some(name);
            Ok(())
        } else if meta.path.is_ident("crate") {
            let path = parse_crate_path(meta.value()?)?;
            if options.krate.is_some() {
                return Err(syn::Error::new(
                    meta.path.span(),
                    "`crate` is given more than once",
                ));
            }
            options.krate = Some(path);
            Ok(())
        } else {
            Err(meta.error(
                "unknown `state` option; the options are `update = NewName` and \
                 `crate = \"path::to::keel_graph\"`",
            ))
        }
    })
}

/// The value of `crate = ..`: a path to keel-graph, as a string literal
/// (`"keel::graph"`, like serde's `#[serde(crate = "..")]`) or bare (`keel::graph`).
/// A module path: no generic arguments.
fn parse_crate_path(input: ParseStream<'_>) -> syn::Result<Path> {
    const EXPECTED: &str = "expected the path keel-graph is reachable at, e.g. \
                            `crate = \"keel::graph\"` or `crate = keel::graph`";
    if input.peek(LitStr) {
        let lit: LitStr = input.parse()?;
        if lit.value().trim().is_empty() {
            return Err(syn::Error::new(lit.span(), EXPECTED));
        }
        return lit
            .parse_with(Path::parse_mod_style)
            .map_err(|e| syn::Error::new(lit.span(), format!("{EXPECTED}: {e}")));
    }
    let ahead = input.fork();
    if ahead.call(Path::parse_mod_style).is_err() {
        return Err(input.error(EXPECTED));
    }
    input.call(Path::parse_mod_style)
}

/// What a `#[reducer]` without its type is told.
const EXPECTED_REDUCER: &str =
    "expected the reducer type: `#[reducer(Type)]` or `#[reducer(Type, with = expr)]`";

/// The inside of `#[reducer(Type)]` or `#[reducer(Type, with = expr)]`.
fn parse_reducer_args(input: ParseStream<'_>) -> syn::Result<(Type, Option<Expr>)> {
    if input.is_empty() {
        return Err(input.error(EXPECTED_REDUCER));
    }
    let ty: Type = input.parse()?;
    if input.is_empty() {
        return Ok((ty, None));
    }
    input.parse::<Token![,]>()?;
    if input.is_empty() {
        return Ok((ty, None));
    }
    let key: Ident = input
        .call(Ident::parse_any)
        .map_err(|e| syn::Error::new(e.span(), "expected `with = expr` after the reducer type"))?;
    if key != "with" {
        return Err(syn::Error::new(
            key.span(),
            format!("unknown `reducer` option `{key}`; the only one is `with = expr`"),
        ));
    }
    input.parse::<Token![=]>()?;
    let expr: Expr = input.parse()?;
    if !input.is_empty() {
        input.parse::<Token![,]>()?;
        if !input.is_empty() {
            return Err(input.error("unexpected tokens after `with = expr`"));
        }
    }
    Ok((ty, Some(expr)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use quote::ToTokens;

    fn parse_str(src: &str) -> syn::Result<StateDef> {
        let input: DeriveInput = syn::parse_str(src)?;
        parse(&input, syn::parse_quote!(::keel_graph))
    }

    fn err(src: &str) -> String {
        match parse_str(src) {
            Ok(_) => String::from("<no error>"),
            Err(e) => e
                .into_iter()
                .map(|e| e.to_string())
                .collect::<Vec<_>>()
                .join("\n"),
        }
    }

    fn tokens(t: &impl ToTokens) -> String {
        t.to_token_stream().to_string().replace(' ', "")
    }

    #[test]
    fn reads_fields_reducers_and_with() -> syn::Result<()> {
        let def = parse_str(
            "pub(crate) struct Chat {
                /// The conversation.
                #[reducer(AddMessages)]
                messages: Messages,
                step: u32,
                #[reducer(KeepLast<String>, with = KeepLast::new(5))]
                recent: VecDeque<String>,
                #[reducer(Sum<i64>, with = Sum::default(),)]
                r#type: i64,
            }",
        )?;
        assert_eq!(def.name, "Chat");
        assert_eq!(def.update, "ChatUpdate");
        assert_eq!(tokens(&def.vis), "pub(crate)");
        let names: Vec<_> = def.channels.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["messages", "step", "recent", "type"]);

        let c = &def.channels;
        assert_eq!(tokens(&c[0].reducer), "AddMessages");
        assert!(c[0].with.is_none());
        assert_eq!(c[0].docs.len(), 1);
        assert_eq!(
            tokens(&c[1].reducer),
            "::keel_graph::reducer::LastValue<u32>"
        );
        assert_eq!(tokens(&c[2].reducer), "KeepLast<String>");
        assert_eq!(
            c[2].with.as_ref().map(tokens).as_deref(),
            Some("KeepLast::new(5)")
        );
        assert_eq!(tokens(&c[3].field), "r#type");
        assert_eq!(
            c[3].with.as_ref().map(tokens).as_deref(),
            Some("Sum::default()")
        );
        Ok(())
    }

    #[test]
    fn renames_the_update_type() -> syn::Result<()> {
        let def = parse_str("#[state(update = Delta)] struct S { a: u8 }")?;
        assert_eq!(def.update, "Delta");
        Ok(())
    }

    #[test]
    fn crate_path_defaults_to_keel_graph() -> syn::Result<()> {
        let def = parse_str("struct S { a: u8 }")?;
        assert_eq!(tokens(&def.krate), "::keel_graph");
        Ok(())
    }

    #[test]
    fn crate_path_as_string_or_bare_path() -> syn::Result<()> {
        for (attr, want) in [
            (r#"#[state(crate = "keel::graph")]"#, "keel::graph"),
            (r#"#[state(crate = "::keel::graph")]"#, "::keel::graph"),
            ("#[state(crate = keel::graph)]", "keel::graph"),
            (
                r#"#[state(crate = "crate::reexport::graph")]"#,
                "crate::reexport::graph",
            ),
            ("#[state(crate = self::graph)]", "self::graph"),
        ] {
            let def = parse_str(&format!("{attr} struct S {{ a: u8 }}"))?;
            assert_eq!(tokens(&def.krate), want, "{attr}");
            // The default reducer is named through the path too.
            assert_eq!(
                tokens(&def.channels[0].reducer),
                format!("{want}::reducer::LastValue<u8>"),
                "{attr}"
            );
        }
        Ok(())
    }

    #[test]
    fn crate_path_with_update_in_one_or_two_attributes() -> syn::Result<()> {
        let def = parse_str(r#"#[state(update = D, crate = "k::g")] struct S { a: u8 }"#)?;
        assert_eq!(
            (def.update.to_string(), tokens(&def.krate)),
            ("D".into(), "k::g".into())
        );
        let def = parse_str("#[state(crate = k::g)] #[state(update = D)] struct S { a: u8 }")?;
        assert_eq!(
            (def.update.to_string(), tokens(&def.krate)),
            ("D".into(), "k::g".into())
        );
        Ok(())
    }

    #[test]
    fn rejects_malformed_crate_paths() {
        for (attr, want) in [
            (
                r#"#[state(crate = "")]"#,
                "expected the path keel-graph is reachable at",
            ),
            (
                r#"#[state(crate = "  ")]"#,
                "expected the path keel-graph is reachable at",
            ),
            (
                r#"#[state(crate = "keel graph")]"#,
                "expected the path keel-graph is reachable at",
            ),
            (
                r#"#[state(crate = "keel::")]"#,
                "expected the path keel-graph is reachable at",
            ),
            (
                r#"#[state(crate = "keel::graph<u8>")]"#,
                "expected the path keel-graph is reachable at",
            ),
            (
                "#[state(crate = 3)]",
                "expected the path keel-graph is reachable at",
            ),
            ("#[state(crate)]", "expected `=`"),
            (
                r#"#[state(crate = "a", crate = "b")]"#,
                "`crate` is given more than once",
            ),
            ("#[state(krate = a)]", "unknown `state` option"),
        ] {
            let got = err(&format!("{attr} struct S {{ a: u8 }}"));
            assert!(got.contains(want), "{attr}: {got}");
        }
    }

    #[test]
    fn empty_struct_is_a_state_without_channels() -> syn::Result<()> {
        let def = parse_str("struct Nothing {}")?;
        assert!(def.channels.is_empty());
        Ok(())
    }

    #[test]
    fn rejects_other_shapes() {
        assert!(err("enum E { A }").contains("not an enum"));
        assert!(err("struct T(u32);").contains("not a tuple struct"));
        assert!(err("struct U;").contains("not a unit struct"));
        assert!(err("union V { a: u32 }").contains("not a union"));
    }

    #[test]
    fn rejects_generics() {
        assert!(err("struct G<T> { a: T }").contains("does not support generic structs"));
        assert!(
            err("struct G where u8: Copy { a: u8 }").contains("does not support generic structs")
        );
    }

    #[test]
    fn rejects_bad_attributes() {
        assert!(err("struct S { #[reducer] a: u8 }").contains("expected the reducer type"));
        assert!(err("struct S { #[reducer()] a: u8 }").contains("expected the reducer type"));
        assert!(
            err("struct S { #[reducer(Sum<u8>, init = 3)] a: u8 }")
                .contains("unknown `reducer` option `init`")
        );
        assert!(
            err("struct S { #[reducer(Sum<u8>, with = 1, 2)] a: u8 }")
                .contains("unexpected tokens")
        );
        assert!(
            err("struct S { #[reducer(Sum<u8>)] #[reducer(Max<u8>)] a: u8 }")
                .contains("one `#[reducer(..)]`")
        );
        assert!(err("struct S { #[state(update = X)] a: u8 }").contains("goes on the struct"));
        assert!(err("#[reducer(Sum<u8>)] struct S { a: u8 }").contains("goes on a field"));
        assert!(err("#[state(name = X)] struct S { a: u8 }").contains("unknown `state` option"));
        assert!(
            err("#[state(update = X, update = Y)] struct S { a: u8 }").contains("more than once")
        );
    }

    #[test]
    fn reports_every_error() {
        let all =
            err("#[state(bogus)] struct S<T> { #[reducer] a: T, #[reducer(X, y = 1)] b: u8 }");
        assert_eq!(all.lines().count(), 4, "{all}");
    }
}
