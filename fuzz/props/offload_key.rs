//! The properties of keel-offload's key validation over any text, shared by the
//! `offload_key` fuzz target and keel-offload's corpus replay test
//! (tests/fuzz_corpus.rs).
//!
//! The input is read as UTF-8 (lossily) and split at its first tab (a control
//! character, so never part of a valid key) into `a` and an optional `b`.
//!
//! * Validation never panics: a [`ThreadId`], [`StorePath`] or [`Key`], or a typed
//!   [`OffloadError::InvalidKey`].
//! * A valid thread id is one plain component; a valid path is relative, within the
//!   length limits, and made of plain components that a filesystem join keeps below
//!   its root; either reads back as the text it was made from.
//! * A key prints as `thread/path` and parses back from that; `join` and
//!   `starts_with` agree with the components.
//! * [`safe_component`] always gives one valid component, the same for the same text,
//!   and two different texts (`a` and `b`, and each beside the other's component)
//!   never get the same one.

use std::path::{Component, Path};

use keel_offload::{
    Key, MAX_COMPONENT_BYTES, MAX_PATH_BYTES, OffloadError, StorePath, ThreadId, safe_component,
};

/// The properties for `data`.
pub fn check_offload_key(data: &[u8]) -> Result<(), String> {
    let text = String::from_utf8_lossy(data);
    let (a, b) = match text.split_once('\t') {
        Some((a, b)) => (a, Some(b)),
        None => (text.as_ref(), None),
    };
    let path_a = check_one(a)?;
    let Some(b) = b else {
        return Ok(());
    };
    let path_b = check_one(b)?;
    check_key(a, b)?;
    check_distinct(a, b)?;
    check_distinct(&safe_component(a), b)?;
    check_distinct(a, &safe_component(b))?;
    if let Some(dir) = &path_a {
        check_join(dir, b)?;
        if let Some(other) = &path_b {
            let by_components = {
                let (mut mine, mut theirs) = (dir.components(), other.components());
                loop {
                    match (mine.next(), theirs.next()) {
                        (_, None) => break true,
                        (Some(x), Some(y)) if x == y => {}
                        _ => break false,
                    }
                }
            };
            if dir.starts_with(other) != by_components {
                return Err(format!(
                    "{dir:?}.starts_with({other:?}) is {}, by components {by_components}",
                    dir.starts_with(other)
                ));
            }
        }
    }
    Ok(())
}

/// Is `e` the typed error of a key that failed validation?
fn invalid_key(what: &str, s: &str, e: &OffloadError) -> Result<(), String> {
    match e {
        OffloadError::InvalidKey { .. } if !e.to_string().is_empty() => Ok(()),
        other => Err(format!("{what} {s:?} failed with {other:?}")),
    }
}

/// The thread id, path and component properties of one text; its path, if valid.
fn check_one(s: &str) -> Result<Option<StorePath>, String> {
    match ThreadId::new(s) {
        Ok(t) => {
            let plain = !s.is_empty()
                && s.len() <= MAX_COMPONENT_BYTES
                && !s.starts_with('.')
                && !s.chars().any(|c| c == '/' || c == '\\' || c.is_control());
            if !plain || t.as_str() != s || t.to_string() != s {
                return Err(format!("thread id {s:?} accepted as {t:?}"));
            }
        }
        Err(e) => invalid_key("thread id", s, &e)?,
    }
    let path = match StorePath::new(s) {
        Ok(p) => p,
        Err(e) => {
            invalid_key("path", s, &e)?;
            return check_component(s).map(|()| None);
        }
    };
    if path.as_str() != s || path.to_string() != s || s.len() > MAX_PATH_BYTES {
        return Err(format!("path {s:?} accepted as {path:?}"));
    }
    if s.starts_with('/') || s.chars().any(|c| c == '\\' || c.is_control()) {
        return Err(format!("path {s:?} accepted"));
    }
    for c in path.components() {
        if c.is_empty() || c == "." || c == ".." || c.len() > MAX_COMPONENT_BYTES {
            return Err(format!("path {s:?} accepted with the component {c:?}"));
        }
    }
    if path.components().collect::<Vec<_>>().join("/") != s {
        return Err(format!("the components of {s:?} do not spell it"));
    }
    // What a filesystem store does with it: stays below the root.
    let under = Path::new("/store/thread").join(path.as_str());
    if !under.starts_with("/store/thread")
        || under
            .components()
            .skip(3)
            .any(|c| !matches!(c, Component::Normal(_)))
    {
        return Err(format!("path {s:?} leaves its root as {}", under.display()));
    }
    match StorePath::try_from(path.as_str()) {
        Ok(again) if again == path => {}
        other => return Err(format!("path {s:?} parses back as {other:?}")),
    }
    check_component(s)?;
    Ok(Some(path))
}

fn check_component(s: &str) -> Result<(), String> {
    let c = safe_component(s);
    if c != safe_component(s) {
        return Err(format!("safe_component({s:?}) is not deterministic"));
    }
    match StorePath::new(c.clone()) {
        Ok(p) if p.components().count() == 1 => Ok(()),
        other => Err(format!("safe_component({s:?}) = {c:?} is {other:?}")),
    }
}

/// Different texts get different components.
fn check_distinct(a: &str, b: &str) -> Result<(), String> {
    if a != b && safe_component(a) == safe_component(b) {
        return Err(format!(
            "safe_component({a:?}) and safe_component({b:?}) are both {:?}",
            safe_component(a)
        ));
    }
    Ok(())
}

/// `Key::new(a, b)`: valid iff both parts are; prints as `a/b`; parses back.
fn check_key(a: &str, b: &str) -> Result<(), String> {
    let valid_parts = ThreadId::new(a).is_ok() && StorePath::new(b).is_ok();
    match Key::new(a, b) {
        Ok(key) => {
            if !valid_parts {
                return Err(format!("key ({a:?}, {b:?}) accepted with an invalid part"));
            }
            let shown = key.to_string();
            let back = shown
                .split_once('/')
                .map(|(t, p)| Key::new(t, p))
                .ok_or_else(|| format!("key {shown:?} has no `/`"))?;
            match back {
                Ok(again) if again == key => {}
                other => return Err(format!("key {shown:?} parses back as {other:?}")),
            }
            if Key::from_parts(key.thread().clone(), key.path().clone()) != key {
                return Err(format!("key {shown:?} from its parts differs"));
            }
        }
        Err(e) => {
            invalid_key("key", &format!("{a}/{b}"), &e)?;
            if valid_parts {
                return Err(format!("key ({a:?}, {b:?}) refused with valid parts"));
            }
        }
    }
    Ok(())
}

/// `dir.join(b)`: valid iff `dir/b` is a valid path, one component longer.
fn check_join(dir: &StorePath, b: &str) -> Result<(), String> {
    let joined = format!("{dir}/{b}");
    match (dir.join(b), StorePath::new(joined.as_str())) {
        (Ok(j), Ok(p)) if j == p => {
            if !j.starts_with(dir) {
                return Err(format!("{j:?} is not under {dir:?}"));
            }
            Ok(())
        }
        (Err(_), Err(_)) => Ok(()),
        (j, p) => Err(format!("{dir:?}.join({b:?}) is {j:?}, the path {p:?}")),
    }
}
