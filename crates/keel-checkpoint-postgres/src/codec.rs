//! Converting between keel's types and column values, and refusing what PostgreSQL
//! cannot store before it is sent.

use std::collections::BTreeMap;
use std::error::Error;

use bytes::{BufMut, BytesMut};
use keel_checkpoint::{ChannelVersion, Checkpoint, CheckpointError, CheckpointId};
use serde_json::{Map, Value};
use tokio_postgres::types::{FromSql, IsNull, ToSql, Type, to_sql_checked};
use uuid::Uuid;

/// The longest thread id stored, in bytes: key columns must fit a btree index entry
/// (about 2.7 KB with the other key columns). The contract's bound for every saver.
pub const MAX_THREAD_ID_BYTES: usize = keel_checkpoint::MAX_THREAD_ID_BYTES;
/// The longest namespace, channel name or task id stored, in bytes.
pub const MAX_NAME_BYTES: usize = 512;

type BoxError = Box<dyn Error + Sync + Send>;

/// JSON text sent as a `json` or `jsonb` parameter without re-encoding.
#[derive(Debug)]
pub(crate) struct JsonText<'a>(pub &'a str);

impl ToSql for JsonText<'_> {
    fn to_sql(&self, ty: &Type, out: &mut BytesMut) -> Result<IsNull, BoxError> {
        if *ty == Type::JSONB {
            out.put_u8(1); // jsonb binary format version
        }
        out.extend_from_slice(self.0.as_bytes());
        Ok(IsNull::No)
    }

    fn accepts(ty: &Type) -> bool {
        matches!(*ty, Type::JSON | Type::JSONB)
    }

    to_sql_checked!();
}

/// JSON text read from a `json` or `jsonb` column without decoding it twice.
#[derive(Debug)]
pub(crate) struct RawJson<'a>(pub &'a str);

impl<'a> FromSql<'a> for RawJson<'a> {
    fn from_sql(ty: &Type, raw: &'a [u8]) -> Result<Self, BoxError> {
        let raw = if *ty == Type::JSONB {
            match raw.split_first() {
                Some((1, rest)) => rest,
                _ => return Err("unsupported jsonb format version".into()),
            }
        } else {
            raw
        };
        Ok(RawJson(std::str::from_utf8(raw)?))
    }

    fn accepts(ty: &Type) -> bool {
        matches!(*ty, Type::JSON | Type::JSONB)
    }
}

impl RawJson<'_> {
    pub(crate) fn parse<T: serde::de::DeserializeOwned>(
        &self,
        what: &str,
    ) -> Result<T, CheckpointError> {
        serde_json::from_str(self.0).map_err(|e| CheckpointError::Corrupt {
            what: format!("{what} is not valid JSON of the expected shape: {e}"),
        })
    }
}

pub(crate) fn to_json<T: serde::Serialize + ?Sized>(
    value: &T,
    what: &str,
) -> Result<String, CheckpointError> {
    serde_json::to_string(value).map_err(|e| CheckpointError::Invalid {
        reason: format!("{what} cannot be encoded as JSON: {e}"),
    })
}

pub(crate) fn uuid_of(id: &CheckpointId) -> Result<Uuid, CheckpointError> {
    Uuid::parse_str(id.as_str()).map_err(|e| CheckpointError::Invalid {
        reason: format!("checkpoint id {id} is not a UUID: {e}"),
    })
}

pub(crate) fn id_of(uuid: Uuid) -> Result<CheckpointId, CheckpointError> {
    uuid.hyphenated()
        .to_string()
        .parse()
        .map_err(|e| CheckpointError::Corrupt {
            what: format!("stored checkpoint id: {e}"),
        })
}

/// Refuses text PostgreSQL cannot store (NUL) or index (too long), naming the field.
pub(crate) fn check_text(
    field: &str,
    text: &str,
    max: Option<usize>,
) -> Result<(), CheckpointError> {
    if text.contains('\0') {
        return Err(CheckpointError::Invalid {
            reason: format!(
                "{field} contains a NUL character (U+0000), which PostgreSQL text cannot store"
            ),
        });
    }
    if let Some(max) = max
        && text.len() > max
    {
        return Err(CheckpointError::Invalid {
            reason: format!(
                "{field} is {} bytes; the Postgres saver stores at most {max} (it is part of an index key)",
                text.len()
            ),
        });
    }
    Ok(())
}

pub(crate) fn check_thread(thread_id: &str, ns: &str) -> Result<(), CheckpointError> {
    check_text("thread id", thread_id, Some(MAX_THREAD_ID_BYTES))?;
    check_text("checkpoint namespace", ns, Some(MAX_NAME_BYTES))
}

/// Refuses metadata with NUL in any key or string: `jsonb` cannot hold U+0000.
pub(crate) fn check_jsonb(field: &str, value: &Value) -> Result<(), CheckpointError> {
    let nul = || CheckpointError::Invalid {
        reason: format!(
            "{field} contains a NUL character (U+0000), which PostgreSQL jsonb cannot store"
        ),
    };
    match value {
        Value::String(s) if s.contains('\0') => Err(nul()),
        Value::Array(items) => items.iter().try_for_each(|v| check_jsonb(field, v)),
        Value::Object(map) => check_jsonb_map(field, map),
        _ => Ok(()),
    }
}

pub(crate) fn check_jsonb_map(
    field: &str,
    map: &Map<String, Value>,
) -> Result<(), CheckpointError> {
    for (key, value) in map {
        if key.contains('\0') {
            return Err(CheckpointError::Invalid {
                reason: format!(
                    "{field} has a key with a NUL character (U+0000), which PostgreSQL jsonb cannot store"
                ),
            });
        }
        check_jsonb(field, value)?;
    }
    Ok(())
}

/// Whether a filter could match anything stored in `jsonb` (no NUL anywhere).
pub(crate) fn jsonb_storable(map: &Map<String, Value>) -> bool {
    check_jsonb_map("", map).is_ok()
}

/// `channel_versions` as stored: a bare seq for versions this checkpoint wrote,
/// `[seq, "writer"]` for versions carried over from earlier checkpoints.
pub(crate) fn encode_versions(checkpoint: &Checkpoint) -> Result<String, CheckpointError> {
    to_json(&StoredVersions(checkpoint), "channel versions")
}

/// A checkpoint's versions as [`encode_versions`] stores them, serialized straight to
/// text (no JSON tree is built first: a put encodes every channel's version).
struct StoredVersions<'a>(&'a Checkpoint);

impl serde::Serialize for StoredVersions<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let versions = &self.0.channel_versions;
        let mut map = serializer.serialize_map(Some(versions.len()))?;
        for (channel, version) in versions {
            if version.writer == self.0.id {
                map.serialize_entry(channel, &version.seq)?;
            } else {
                map.serialize_entry(channel, &(version.seq, version.writer.as_str()))?;
            }
        }
        map.end()
    }
}

pub(crate) fn decode_versions(
    id: &CheckpointId,
    raw: RawJson<'_>,
) -> Result<BTreeMap<String, ChannelVersion>, CheckpointError> {
    let map: Map<String, Value> = raw.parse("channel versions")?;
    let corrupt = |channel: &str| CheckpointError::Corrupt {
        what: format!("checkpoint {id}: stored version of channel {channel:?} is malformed"),
    };
    let mut versions = BTreeMap::new();
    for (channel, value) in map {
        let version = match &value {
            Value::Number(n) => {
                ChannelVersion::new(n.as_u64().ok_or_else(|| corrupt(&channel))?, id.clone())
            }
            Value::Array(pair) => match pair.as_slice() {
                [Value::Number(seq), Value::String(writer)] => ChannelVersion::new(
                    seq.as_u64().ok_or_else(|| corrupt(&channel))?,
                    writer.parse().map_err(|_| corrupt(&channel))?,
                ),
                _ => return Err(corrupt(&channel)),
            },
            _ => return Err(corrupt(&channel)),
        };
        versions.insert(channel, version);
    }
    Ok(versions)
}

/// A `seq` as a bigint; keel's seqs never come near `i64::MAX`.
pub(crate) fn seq_to_sql(seq: u64) -> Result<i64, CheckpointError> {
    i64::try_from(seq).map_err(|_| CheckpointError::Invalid {
        reason: format!("channel version seq {seq} does not fit a bigint"),
    })
}

pub(crate) fn seq_from_sql(seq: i64) -> Result<u64, CheckpointError> {
    u64::try_from(seq).map_err(|_| CheckpointError::Corrupt {
        what: format!("negative channel version seq {seq}"),
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use serde_json::json;

    use super::*;

    #[test]
    fn versions_round_trip_compactly() {
        let first = Checkpoint::new(None);
        let mut second = first.successor();
        second
            .channel_versions
            .insert("carried".into(), ChannelVersion::new(3, first.id.clone()));
        second
            .channel_versions
            .insert("written".into(), ChannelVersion::new(4, second.id.clone()));
        let text = encode_versions(&second).unwrap();
        assert_eq!(
            text,
            format!(r#"{{"carried":[3,"{}"],"written":4}}"#, first.id)
        );
        let back = decode_versions(&second.id, RawJson(&text)).unwrap();
        assert_eq!(back, second.channel_versions);
        assert!(decode_versions(&second.id, RawJson(r#"{"x":"y"}"#)).is_err());
    }

    #[test]
    fn nul_and_long_text_are_refused_with_the_field_named() {
        let err = check_thread("a\0b", "").unwrap_err().to_string();
        assert!(err.contains("thread id") && err.contains("NUL"), "{err}");
        let long = "é".repeat(MAX_THREAD_ID_BYTES);
        let err = check_thread(&long, "").unwrap_err().to_string();
        assert!(err.contains("at most 1024"), "{err}");
        check_thread("ok \"quoted\" 'single' ünïcødé", "ns").unwrap();
        let meta = json!({"a": [{"b": "x\u{0}y"}]});
        assert!(check_jsonb("metadata", &meta).is_err());
        let mut key = Map::new();
        key.insert("k\0".into(), json!(1));
        assert!(!jsonb_storable(&key));
        assert!(check_jsonb("metadata", &json!({"a": "fine"})).is_ok());
    }
}
