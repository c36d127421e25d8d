//! Element types and reduction kernels.
//!
//! Collectives move bytes; this module gives those bytes a type. Reductions run over byte slices
//! with an explicit fast path (both slices aligned for the element type: a tight loop the compiler
//! vectorises) and a slow path (unaligned reads), as candle's `binary_map` does. bf16 and f16 are
//! reduced in f32 and rounded back once per pairwise reduction.

use crate::error::{CommError, Result};
use half::{bf16, f16};

/// Element type of a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DType {
    F32 = 0,
    F64 = 1,
    BF16 = 2,
    F16 = 3,
    I32 = 4,
    I64 = 5,
    U8 = 6,
}

impl DType {
    /// Every dtype, for sweeps.
    pub const ALL: [DType; 7] = [
        DType::F32,
        DType::F64,
        DType::BF16,
        DType::F16,
        DType::I32,
        DType::I64,
        DType::U8,
    ];

    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::BF16 | DType::F16 => 2,
            DType::U8 => 1,
        }
    }

    /// Lower-case name (`f32`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U8 => "u8",
        }
    }

    /// Decodes the wire tag written by `as u8`.
    pub fn from_u8(v: u8) -> Option<DType> {
        DType::ALL.get(v as usize).copied()
    }

    /// Parses a name as printed by [`DType::name`].
    pub fn parse(s: &str) -> Result<DType> {
        DType::ALL
            .into_iter()
            .find(|d| d.name() == s)
            .ok_or_else(|| {
                CommError::InvalidArgument(format!(
                    "unknown dtype '{s}' (expected one of f32, f64, bf16, f16, i32, i64, u8)"
                ))
            })
    }
}

/// Reduction operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ReduceOp {
    Sum = 0,
    /// Sum, then divided by the group size (integer division for integer dtypes).
    Avg = 1,
    Min = 2,
    Max = 3,
    Prod = 4,
}

impl ReduceOp {
    /// Every operator, for sweeps.
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Avg,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Prod,
    ];

    /// Lower-case name.
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Prod => "prod",
        }
    }

    /// The pairwise operator used while combining (avg combines as a sum).
    pub const fn combiner(self) -> ReduceOp {
        match self {
            ReduceOp::Avg => ReduceOp::Sum,
            o => o,
        }
    }
}

/// A Rust type that can travel through a collective.
pub trait Element: Copy + Send + Sync + 'static {
    /// The matching dtype tag.
    const DTYPE: DType;
    /// `a op b`.
    fn combine(a: Self, b: Self, op: ReduceOp) -> Self;
    /// `self / n`, for [`ReduceOp::Avg`].
    fn div_count(self, n: usize) -> Self;
}

macro_rules! float_element {
    ($t:ty, $d:expr) => {
        impl Element for $t {
            const DTYPE: DType = $d;
            #[inline(always)]
            fn combine(a: Self, b: Self, op: ReduceOp) -> Self {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => a + b,
                    ReduceOp::Min => a.min(b),
                    ReduceOp::Max => a.max(b),
                    ReduceOp::Prod => a * b,
                }
            }
            #[inline(always)]
            fn div_count(self, n: usize) -> Self {
                self / n as $t
            }
        }
    };
}
float_element!(f32, DType::F32);
float_element!(f64, DType::F64);

macro_rules! int_element {
    ($t:ty, $d:expr) => {
        impl Element for $t {
            const DTYPE: DType = $d;
            #[inline(always)]
            fn combine(a: Self, b: Self, op: ReduceOp) -> Self {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => a.wrapping_add(b),
                    ReduceOp::Min => a.min(b),
                    ReduceOp::Max => a.max(b),
                    ReduceOp::Prod => a.wrapping_mul(b),
                }
            }
            #[inline(always)]
            fn div_count(self, n: usize) -> Self {
                self / n as $t
            }
        }
    };
}
int_element!(i32, DType::I32);
int_element!(i64, DType::I64);
int_element!(u8, DType::U8);

macro_rules! half_element {
    ($t:ty, $d:expr) => {
        impl Element for $t {
            const DTYPE: DType = $d;
            #[inline(always)]
            fn combine(a: Self, b: Self, op: ReduceOp) -> Self {
                <$t>::from_f32(f32::combine(a.to_f32(), b.to_f32(), op))
            }
            #[inline(always)]
            fn div_count(self, n: usize) -> Self {
                <$t>::from_f32(self.to_f32() / n as f32)
            }
        }
    };
}
half_element!(bf16, DType::BF16);
half_element!(f16, DType::F16);

/// Views a typed slice as bytes.
pub fn as_bytes<T: Element>(s: &[T]) -> &[u8] {
    // SAFETY: every Element is a plain-old-data type without padding; u8 has alignment 1.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast(), std::mem::size_of_val(s)) }
}

/// Views a mutable typed slice as bytes.
pub fn as_bytes_mut<T: Element>(s: &mut [T]) -> &mut [u8] {
    // SAFETY: as in `as_bytes`; every bit pattern is a valid Element.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast(), std::mem::size_of_val(s)) }
}

/// Fast path: both slices aligned; one tight loop per operator so it vectorises.
#[inline(always)]
fn combine_aligned<T: Element>(a: &mut [T], s: &[T], op: ReduceOp) {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => a
            .iter_mut()
            .zip(s)
            .for_each(|(x, y)| *x = T::combine(*x, *y, ReduceOp::Sum)),
        ReduceOp::Min => a
            .iter_mut()
            .zip(s)
            .for_each(|(x, y)| *x = T::combine(*x, *y, ReduceOp::Min)),
        ReduceOp::Max => a
            .iter_mut()
            .zip(s)
            .for_each(|(x, y)| *x = T::combine(*x, *y, ReduceOp::Max)),
        ReduceOp::Prod => a
            .iter_mut()
            .zip(s)
            .for_each(|(x, y)| *x = T::combine(*x, *y, ReduceOp::Prod)),
    }
}

/// The same loop compiled for AVX2 (256-bit vectors instead of the baseline's 128-bit SSE2).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn combine_aligned_avx2<T: Element>(a: &mut [T], s: &[T], op: ReduceOp) {
    combine_aligned(a, s, op)
}

/// Picks the widest loop this CPU runs (checked once; the check is cached by std).
#[inline]
fn combine_aligned_dispatch<T: Element>(a: &mut [T], s: &[T], op: ReduceOp) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above).
        unsafe { combine_aligned_avx2(a, s, op) };
        return;
    }
    combine_aligned(a, s, op)
}

#[inline]
fn reduce_typed<T: Element>(acc: &mut [u8], src: &[u8], op: ReduceOp) {
    let n = acc.len() / std::mem::size_of::<T>();
    // SAFETY: align_to only yields a non-empty middle for correctly aligned, in-bounds elements.
    let (ap, am, _) = unsafe { acc.align_to_mut::<T>() };
    let (sp, sm, _) = unsafe { src.align_to::<T>() };
    if ap.is_empty() && sp.is_empty() && am.len() >= n && sm.len() >= n {
        combine_aligned_dispatch(&mut am[..n], &sm[..n], op);
        return;
    }
    // Slow path: unaligned element-by-element.
    let sz = std::mem::size_of::<T>();
    for i in 0..n {
        // SAFETY: i*sz+sz <= len for both slices (checked by the caller).
        unsafe {
            let pa = acc.as_mut_ptr().add(i * sz).cast::<T>();
            let pb = src.as_ptr().add(i * sz).cast::<T>();
            pa.write_unaligned(T::combine(pa.read_unaligned(), pb.read_unaligned(), op));
        }
    }
}

/// `acc[i] = acc[i] op src[i]` over whole elements of `dtype`. Both slices must have the same
/// length, a multiple of the element size.
pub fn reduce_into(dtype: DType, op: ReduceOp, acc: &mut [u8], src: &[u8]) {
    debug_assert_eq!(acc.len(), src.len());
    debug_assert_eq!(acc.len() % dtype.size(), 0);
    let op = op.combiner();
    match dtype {
        DType::F32 => reduce_typed::<f32>(acc, src, op),
        DType::F64 => reduce_typed::<f64>(acc, src, op),
        DType::BF16 => reduce_typed::<bf16>(acc, src, op),
        DType::F16 => reduce_typed::<f16>(acc, src, op),
        DType::I32 => reduce_typed::<i32>(acc, src, op),
        DType::I64 => reduce_typed::<i64>(acc, src, op),
        DType::U8 => reduce_typed::<u8>(acc, src, op),
    }
}

fn scale_typed<T: Element>(buf: &mut [u8], n: usize) {
    let sz = std::mem::size_of::<T>();
    for i in 0..buf.len() / sz {
        // SAFETY: in bounds; unaligned access is allowed.
        unsafe {
            let p = buf.as_mut_ptr().add(i * sz).cast::<T>();
            p.write_unaligned(p.read_unaligned().div_count(n));
        }
    }
}

/// Finishes a reduction: for [`ReduceOp::Avg`] divides every element by `group_size`; other
/// operators leave the buffer as it is.
pub fn finish_reduce(dtype: DType, op: ReduceOp, buf: &mut [u8], group_size: usize) {
    if op != ReduceOp::Avg || group_size <= 1 {
        return;
    }
    match dtype {
        DType::F32 => scale_typed::<f32>(buf, group_size),
        DType::F64 => scale_typed::<f64>(buf, group_size),
        DType::BF16 => scale_typed::<bf16>(buf, group_size),
        DType::F16 => scale_typed::<f16>(buf, group_size),
        DType::I32 => scale_typed::<i32>(buf, group_size),
        DType::I64 => scale_typed::<i64>(buf, group_size),
        DType::U8 => scale_typed::<u8>(buf, group_size),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sum_aligned_and_unaligned_agree() {
        let a: Vec<f32> = (0..37).map(|i| i as f32).collect();
        let b: Vec<f32> = (0..37).map(|i| (2 * i) as f32).collect();
        let mut fast = a.clone();
        reduce_into(
            DType::F32,
            ReduceOp::Sum,
            as_bytes_mut(&mut fast),
            as_bytes(&b),
        );
        // Shift by one byte to force the slow path.
        let mut raw = [0u8; 37 * 4 + 1];
        raw[1..].copy_from_slice(as_bytes(&a));
        let mut src = [0u8; 37 * 4 + 1];
        src[1..].copy_from_slice(as_bytes(&b));
        reduce_into(DType::F32, ReduceOp::Sum, &mut raw[1..], &src[1..]);
        assert_eq!(&raw[1..], as_bytes(&fast));
        assert_eq!(fast[36], 36.0 * 3.0);
    }

    #[test]
    fn bf16_reduces_in_f32() {
        let mut a = [bf16::from_f32(1.0), bf16::from_f32(3.0)];
        let b = [bf16::from_f32(2.0), bf16::from_f32(-1.0)];
        reduce_into(
            DType::BF16,
            ReduceOp::Max,
            as_bytes_mut(&mut a),
            as_bytes(&b),
        );
        assert_eq!(a, [bf16::from_f32(2.0), bf16::from_f32(3.0)]);
    }

    #[test]
    fn avg_divides_integers() {
        let mut a = [10i64, 7];
        finish_reduce(DType::I64, ReduceOp::Avg, as_bytes_mut(&mut a), 3);
        assert_eq!(a, [3, 2]);
    }

    #[test]
    fn parse_names_round_trip() {
        for d in DType::ALL {
            assert_eq!(DType::parse(d.name()).unwrap(), d);
            assert_eq!(DType::from_u8(d as u8), Some(d));
        }
        assert!(DType::parse("f8").is_err());
    }
}
