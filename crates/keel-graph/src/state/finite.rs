//! Finds a float JSON cannot hold.
//!
//! serde_json writes NaN and the infinities as `null`, which an `f64` field then cannot
//! read back: a state holding one would be stored and then fail every load of its
//! thread. [`check`] walks a value's serialization (writing nothing) and fails at the
//! first such float, so the write is refused instead.

use serde::Serialize;
use serde::ser;

/// Why the walk stopped.
#[derive(Debug)]
pub(crate) enum NonFinite {
    /// A float JSON cannot hold.
    Found(f64),
    /// The value's own serialization failed (the encoder reports that).
    Other,
}

impl std::fmt::Display for NonFinite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NonFinite::Found(v) => write!(f, "{v}"),
            NonFinite::Other => f.write_str("not serializable"),
        }
    }
}

impl std::error::Error for NonFinite {}

impl ser::Error for NonFinite {
    fn custom<T: std::fmt::Display>(_: T) -> Self {
        NonFinite::Other
    }
}

/// `Err` with the float when `value` holds a NaN or an infinity.
pub(crate) fn check<T: Serialize + ?Sized>(value: &T) -> Result<(), f64> {
    match value.serialize(&mut Walk) {
        Err(NonFinite::Found(v)) => Err(v),
        _ => Ok(()),
    }
}

struct Walk;

fn float(v: f64) -> Result<(), NonFinite> {
    if v.is_finite() {
        Ok(())
    } else {
        Err(NonFinite::Found(v))
    }
}

macro_rules! ignore {
    ($($name:ident: $ty:ty),* $(,)?) => {
        $(fn $name(self, _: $ty) -> Result<(), NonFinite> { Ok(()) })*
    };
}

impl ser::Serializer for &mut Walk {
    type Ok = ();
    type Error = NonFinite;
    type SerializeSeq = Self;
    type SerializeTuple = Self;
    type SerializeTupleStruct = Self;
    type SerializeTupleVariant = Self;
    type SerializeMap = Self;
    type SerializeStruct = Self;
    type SerializeStructVariant = Self;

    ignore!(
        serialize_bool: bool,
        serialize_i8: i8,
        serialize_i16: i16,
        serialize_i32: i32,
        serialize_i64: i64,
        serialize_i128: i128,
        serialize_u8: u8,
        serialize_u16: u16,
        serialize_u32: u32,
        serialize_u64: u64,
        serialize_u128: u128,
        serialize_char: char,
        serialize_str: &str,
        serialize_bytes: &[u8],
        serialize_unit_struct: &'static str,
    );

    fn serialize_f32(self, v: f32) -> Result<(), NonFinite> {
        float(f64::from(v))
    }
    fn serialize_f64(self, v: f64) -> Result<(), NonFinite> {
        float(v)
    }
    fn serialize_none(self) -> Result<(), NonFinite> {
        Ok(())
    }
    fn serialize_some<T: Serialize + ?Sized>(self, v: &T) -> Result<(), NonFinite> {
        v.serialize(self)
    }
    fn serialize_unit(self) -> Result<(), NonFinite> {
        Ok(())
    }
    fn serialize_unit_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
    ) -> Result<(), NonFinite> {
        Ok(())
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        v: &T,
    ) -> Result<(), NonFinite> {
        v.serialize(self)
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        v: &T,
    ) -> Result<(), NonFinite> {
        v.serialize(self)
    }
    fn serialize_seq(self, _: Option<usize>) -> Result<Self, NonFinite> {
        Ok(self)
    }
    fn serialize_tuple(self, _: usize) -> Result<Self, NonFinite> {
        Ok(self)
    }
    fn serialize_tuple_struct(self, _: &'static str, _: usize) -> Result<Self, NonFinite> {
        Ok(self)
    }
    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Self, NonFinite> {
        Ok(self)
    }
    fn serialize_map(self, _: Option<usize>) -> Result<Self, NonFinite> {
        Ok(self)
    }
    fn serialize_struct(self, _: &'static str, _: usize) -> Result<Self, NonFinite> {
        Ok(self)
    }
    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Self, NonFinite> {
        Ok(self)
    }
}

macro_rules! elements {
    ($($trait:ident :: $method:ident),* $(,)?) => {
        $(impl ser::$trait for &mut Walk {
            type Ok = ();
            type Error = NonFinite;
            fn $method<T: Serialize + ?Sized>(&mut self, v: &T) -> Result<(), NonFinite> {
                v.serialize(&mut **self)
            }
            fn end(self) -> Result<(), NonFinite> {
                Ok(())
            }
        })*
    };
}

elements!(
    SerializeSeq::serialize_element,
    SerializeTuple::serialize_element,
    SerializeTupleStruct::serialize_field,
    SerializeTupleVariant::serialize_field,
);

macro_rules! fields {
    ($($trait:ident),* $(,)?) => {
        $(impl ser::$trait for &mut Walk {
            type Ok = ();
            type Error = NonFinite;
            fn serialize_field<T: Serialize + ?Sized>(
                &mut self,
                _: &'static str,
                v: &T,
            ) -> Result<(), NonFinite> {
                v.serialize(&mut **self)
            }
            fn end(self) -> Result<(), NonFinite> {
                Ok(())
            }
        })*
    };
}

fields!(SerializeStruct, SerializeStructVariant);

impl ser::SerializeMap for &mut Walk {
    type Ok = ();
    type Error = NonFinite;
    fn serialize_key<T: Serialize + ?Sized>(&mut self, k: &T) -> Result<(), NonFinite> {
        k.serialize(&mut **self)
    }
    fn serialize_value<T: Serialize + ?Sized>(&mut self, v: &T) -> Result<(), NonFinite> {
        v.serialize(&mut **self)
    }
    fn end(self) -> Result<(), NonFinite> {
        Ok(())
    }
}
