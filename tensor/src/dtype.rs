//! Element types that ride the buffer plane, and their names in tch and
//! safetensors.

use std::fmt;

use serde::{Deserialize, Serialize};
use tch::Kind;

use crate::error::Error;

/// An element type of a tensor on the buffer plane (a subset of tch's
/// `Kind`: the real and integer types, and bool).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DType {
    /// 32-bit float.
    F32,
    /// 64-bit float.
    F64,
    /// IEEE half.
    F16,
    /// bfloat16.
    BF16,
    /// 64-bit signed integer.
    I64,
    /// 32-bit signed integer.
    I32,
    /// 16-bit signed integer.
    I16,
    /// 8-bit signed integer.
    I8,
    /// 8-bit unsigned integer.
    U8,
    /// Bool, one byte holding 0 or 1.
    Bool,
}

impl DType {
    /// Every type, for tests and tables.
    pub const ALL: [DType; 10] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I64,
        DType::I32,
        DType::I16,
        DType::I8,
        DType::U8,
        DType::Bool,
    ];

    /// Bytes per element.
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 | DType::I16 => 2,
            DType::I8 | DType::U8 | DType::Bool => 1,
        }
    }

    /// Whether it is a floating-point type.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }

    /// The tch kind.
    pub fn kind(self) -> Kind {
        match self {
            DType::F32 => Kind::Float,
            DType::F64 => Kind::Double,
            DType::F16 => Kind::Half,
            DType::BF16 => Kind::BFloat16,
            DType::I64 => Kind::Int64,
            DType::I32 => Kind::Int,
            DType::I16 => Kind::Int16,
            DType::I8 => Kind::Int8,
            DType::U8 => Kind::Uint8,
            DType::Bool => Kind::Bool,
        }
    }

    /// The type of a tch kind; complex, quantized and 8-bit float kinds
    /// are refused.
    pub fn from_kind(kind: Kind) -> Result<Self, Error> {
        Ok(match kind {
            Kind::Float => DType::F32,
            Kind::Double => DType::F64,
            Kind::Half => DType::F16,
            Kind::BFloat16 => DType::BF16,
            Kind::Int64 => DType::I64,
            Kind::Int => DType::I32,
            Kind::Int16 => DType::I16,
            Kind::Int8 => DType::I8,
            Kind::Uint8 => DType::U8,
            Kind::Bool => DType::Bool,
            other => return Err(Error::Unsupported(format!("tensors of kind {other:?}"))),
        })
    }

    /// c10's `ScalarType` number (what libtorch's C++ API takes).
    pub(crate) fn scalar_type(self) -> i32 {
        match self {
            DType::U8 => 0,
            DType::I8 => 1,
            DType::I16 => 2,
            DType::I32 => 3,
            DType::I64 => 4,
            DType::F16 => 5,
            DType::F32 => 6,
            DType::F64 => 7,
            DType::Bool => 11,
            DType::BF16 => 15,
        }
    }

    /// The safetensors type.
    pub fn safetensors(self) -> safetensors::Dtype {
        use safetensors::Dtype as S;
        match self {
            DType::F32 => S::F32,
            DType::F64 => S::F64,
            DType::F16 => S::F16,
            DType::BF16 => S::BF16,
            DType::I64 => S::I64,
            DType::I32 => S::I32,
            DType::I16 => S::I16,
            DType::I8 => S::I8,
            DType::U8 => S::U8,
            DType::Bool => S::BOOL,
        }
    }

    /// The type of a safetensors type; the others are refused.
    pub fn from_safetensors(dtype: safetensors::Dtype) -> Result<Self, Error> {
        use safetensors::Dtype as S;
        Ok(match dtype {
            S::F32 => DType::F32,
            S::F64 => DType::F64,
            S::F16 => DType::F16,
            S::BF16 => DType::BF16,
            S::I64 => DType::I64,
            S::I32 => DType::I32,
            S::I16 => DType::I16,
            S::I8 => DType::I8,
            S::U8 => DType::U8,
            S::BOOL => DType::Bool,
            other => return Err(Error::Unsupported(format!("safetensors dtype {other}"))),
        })
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I64 => "i64",
            DType::I32 => "i32",
            DType::I16 => "i16",
            DType::I8 => "i8",
            DType::U8 => "u8",
            DType::Bool => "bool",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_and_safetensors_types_round_trip_with_matching_sizes() {
        for d in DType::ALL {
            assert_eq!(DType::from_kind(d.kind()).unwrap(), d);
            assert_eq!(d.kind().elt_size_in_bytes(), d.size_bytes(), "{d}");
            assert_eq!(DType::from_safetensors(d.safetensors()).unwrap(), d);
            assert_eq!(d.safetensors().bitsize(), 8 * d.size_bytes(), "{d}");
        }
        assert!(DType::from_kind(Kind::ComplexFloat).is_err());
        assert!(DType::from_safetensors(safetensors::Dtype::U32).is_err());
    }
}
