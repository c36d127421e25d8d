//! Tensor geometry: dtypes, global tensor descriptions, N-d slices and the overlap copy.
//!
//! All tensors are dense and row-major. A [`Slice`] is a box inside a tensor's global shape,
//! one `(offset, len)` [`Extent`] per dimension; a piece buffer holds exactly the elements of
//! its slice, row-major in the slice's own shape. Resharding is then one primitive:
//! [`copy_overlap`] moves the intersection of a source box into a destination box.

use serde::{Deserialize, Serialize};
use std::fmt;

use crate::error::{CkptError, Result};

/// Most dimensions a tensor may have.
pub const MAX_NDIM: usize = 16;
/// Largest tensor, piece or requested slice in bytes (1 TiB); anything larger is refused before
/// any allocation.
pub const MAX_TENSOR_BYTES: u64 = 1 << 40;

/// Element type of a stored tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum DType {
    /// 64-bit IEEE float.
    F64,
    /// 32-bit IEEE float.
    F32,
    /// bfloat16.
    BF16,
    /// 16-bit IEEE float.
    F16,
    /// Signed 64-bit integer.
    I64,
    /// Signed 32-bit integer.
    I32,
    /// Signed 16-bit integer.
    I16,
    /// Signed 8-bit integer.
    I8,
    /// Unsigned 8-bit integer.
    U8,
    /// Boolean, one byte per element.
    Bool,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::BF16 | DType::F16 | DType::I16 => 2,
            DType::I8 | DType::U8 | DType::Bool => 1,
        }
    }
}

/// A logical (global) tensor: its name, element type and full shape.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorMeta {
    /// Unique name within a checkpoint (e.g. `layers.3.attn.wq`).
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Global shape; empty for a scalar.
    pub shape: Vec<u64>,
}

impl TensorMeta {
    /// Byte size of the whole tensor, refused if it overflows or exceeds [`MAX_TENSOR_BYTES`].
    pub fn byte_size(&self) -> Result<u64> {
        Slice::full(&self.shape).byte_size(self.dtype, &self.name)
    }
}

/// One dimension of a [`Slice`]: elements `offset .. offset + len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Extent {
    /// First index covered.
    pub offset: u64,
    /// Number of indices covered.
    pub len: u64,
}

/// A box in a tensor's global index space, one [`Extent`] per dimension.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Slice(pub Vec<Extent>);

impl fmt::Display for Slice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[")?;
        for (i, e) in self.0.iter().enumerate() {
            let sep = if i == 0 { "" } else { ", " };
            write!(f, "{sep}{}..{}", e.offset, e.offset.saturating_add(e.len))?;
        }
        write!(f, "]")
    }
}

impl Slice {
    /// Builds a slice from `(offset, len)` pairs.
    pub fn new(extents: &[(u64, u64)]) -> Self {
        Slice(
            extents
                .iter()
                .map(|&(offset, len)| Extent { offset, len })
                .collect(),
        )
    }

    /// The slice covering a whole tensor of `shape`.
    pub fn full(shape: &[u64]) -> Self {
        Slice(shape.iter().map(|&len| Extent { offset: 0, len }).collect())
    }

    /// Number of dimensions.
    pub fn ndim(&self) -> usize {
        self.0.len()
    }

    /// Number of elements, or `None` on overflow.
    pub fn volume(&self) -> Option<u64> {
        self.0
            .iter()
            .try_fold(1u64, |acc, e| acc.checked_mul(e.len))
    }

    /// Byte size for `dtype`, refused on overflow or above [`MAX_TENSOR_BYTES`]; `what` names
    /// the tensor in the error.
    pub fn byte_size(&self, dtype: DType, what: &str) -> Result<u64> {
        let bytes = self
            .volume()
            .and_then(|v| v.checked_mul(dtype.size() as u64));
        match bytes {
            Some(b) if b <= MAX_TENSOR_BYTES => Ok(b),
            _ => Err(CkptError::SizeLimit {
                what: format!("tensor {what:?} slice {self} of {dtype:?}"),
                size: bytes.unwrap_or(u64::MAX),
                limit: MAX_TENSOR_BYTES,
            }),
        }
    }

    /// Whether the slice lies inside a tensor of `shape` (same rank, no overflow).
    pub fn fits(&self, shape: &[u64]) -> bool {
        self.ndim() == shape.len()
            && self
                .0
                .iter()
                .zip(shape)
                .all(|(e, &dim)| e.offset.checked_add(e.len).is_some_and(|end| end <= dim))
    }

    /// Checks [`Slice::fits`], turning a miss into an error naming `tensor`.
    pub fn check_fits(&self, tensor: &str, shape: &[u64]) -> Result<()> {
        if self.fits(shape) {
            Ok(())
        } else {
            Err(CkptError::SliceOutOfBounds {
                tensor: tensor.to_string(),
                slice: self.to_string(),
                shape: shape.to_vec(),
            })
        }
    }

    /// The non-empty intersection of two slices of the same rank, or `None`.
    ///
    /// Scalars (rank 0) always intersect; slices of different rank never do.
    pub fn overlap(&self, other: &Slice) -> Option<Slice> {
        if self.ndim() != other.ndim() {
            return None;
        }
        let mut out = Vec::with_capacity(self.ndim());
        for (a, b) in self.0.iter().zip(&other.0) {
            let start = a.offset.max(b.offset);
            let end = a
                .offset
                .saturating_add(a.len)
                .min(b.offset.saturating_add(b.len));
            if end <= start {
                return None;
            }
            out.push(Extent {
                offset: start,
                len: end - start,
            });
        }
        Some(Slice(out))
    }
}

/// Row-major element strides of a box with extents `lens`.
fn strides(slice: &Slice) -> Vec<u64> {
    let mut s = vec![1u64; slice.ndim()];
    for d in (0..slice.ndim().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * slice.0[d + 1].len;
    }
    s
}

/// Copies the overlap of `src_slice` and `dst_slice` from `src` into `dst`.
///
/// `src` holds exactly the elements of `src_slice` and `dst` exactly those of `dst_slice`,
/// row-major, `elem` bytes each. Returns the number of elements copied (0 when the boxes do not
/// meet). Trailing dimensions that both boxes hold in full are merged into one contiguous run,
/// so a dim-0 sharding copies each piece with a single `copy_from_slice`.
pub fn copy_overlap(
    src: &[u8],
    src_slice: &Slice,
    dst: &mut [u8],
    dst_slice: &Slice,
    elem: usize,
) -> Result<u64> {
    check_buffer("source piece", src.len(), src_slice, elem)?;
    check_buffer("destination", dst.len(), dst_slice, elem)?;
    if src_slice.ndim() != dst_slice.ndim() {
        return Err(CkptError::RankMismatch {
            src: src_slice.to_string(),
            dst: dst_slice.to_string(),
        });
    }
    let Some(inter) = src_slice.overlap(dst_slice) else {
        return Ok(0);
    };
    let n = inter.ndim();
    // Dimensions k.. form one contiguous run: every dimension after k is held in full by the
    // intersection, the source and the destination alike.
    let mut k = n.saturating_sub(1);
    while k > 0 {
        let (i, s, d) = (inter.0[k].len, src_slice.0[k].len, dst_slice.0[k].len);
        if i != s || i != d {
            break;
        }
        k -= 1;
    }
    let run_elems: u64 = inter.0[k.min(n)..].iter().map(|e| e.len).product();
    let run = run_elems as usize * elem;
    let (ss, ds) = (strides(src_slice), strides(dst_slice));
    // Element offsets of the intersection's first element in each buffer.
    let base = |slice: &Slice, st: &[u64]| -> u64 {
        (0..n)
            .map(|d| (inter.0[d].offset - slice.0[d].offset) * st[d])
            .sum()
    };
    let (src_base, dst_base) = (base(src_slice, &ss), base(dst_slice, &ds));
    // Odometer over the outer dimensions 0..k.
    let mut idx = vec![0u64; k];
    let outer: u64 = inter.0[..k].iter().map(|e| e.len).product();
    for _ in 0..outer {
        let so = src_base + (0..k).map(|d| idx[d] * ss[d]).sum::<u64>();
        let dof = dst_base + (0..k).map(|d| idx[d] * ds[d]).sum::<u64>();
        let (so, dof) = (so as usize * elem, dof as usize * elem);
        dst[dof..dof + run].copy_from_slice(&src[so..so + run]);
        for d in (0..k).rev() {
            idx[d] += 1;
            if idx[d] < inter.0[d].len {
                break;
            }
            idx[d] = 0;
        }
    }
    Ok(outer * run_elems)
}

fn check_buffer(what: &'static str, actual: usize, slice: &Slice, elem: usize) -> Result<()> {
    let expected = slice.volume().and_then(|v| v.checked_mul(elem as u64));
    if expected == Some(actual as u64) {
        Ok(())
    } else {
        Err(CkptError::BufferSize {
            what,
            expected: expected.unwrap_or(u64::MAX),
            actual: actual as u64,
        })
    }
}

#[cfg(target_endian = "big")]
compile_error!("checkpoint tensors are stored little-endian; big-endian hosts are not supported");

/// The bytes of an `f32` buffer as stored in a checkpoint (little-endian, no copy).
pub fn f32_bytes(values: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and any byte pattern is a valid u8; u8's alignment is 1; the
    // length covers exactly the same memory.
    unsafe { std::slice::from_raw_parts(values.as_ptr().cast(), std::mem::size_of_val(values)) }
}

/// Fills `out` from little-endian `f32` bytes; `tensor` names the tensor if the length is wrong.
pub fn f32_from_bytes(bytes: &[u8], out: &mut [f32], tensor: &str) -> Result<()> {
    let expected = std::mem::size_of_val(out) as u64;
    if bytes.len() as u64 != expected {
        return Err(CkptError::TensorSize {
            tensor: tensor.to_string(),
            expected,
            actual: bytes.len() as u64,
        });
    }
    for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
        *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reference copy: element by element through global coordinates.
    fn naive(src: &[u8], ss: &Slice, dst: &mut [u8], ds: &Slice, elem: usize) {
        let Some(inter) = ss.overlap(ds) else { return };
        let pts: Vec<Vec<u64>> = inter.0.iter().fold(vec![vec![]], |acc, e| {
            acc.into_iter()
                .flat_map(|p| {
                    (e.offset..e.offset + e.len).map(move |i| {
                        let mut q = p.clone();
                        q.push(i);
                        q
                    })
                })
                .collect()
        });
        let lin = |s: &Slice, p: &[u64]| -> usize {
            let st = strides(s);
            (0..p.len())
                .map(|d| (p[d] - s.0[d].offset) * st[d])
                .sum::<u64>() as usize
        };
        for p in pts {
            let (a, b) = (lin(ss, &p) * elem, lin(ds, &p) * elem);
            dst[b..b + elem].copy_from_slice(&src[a..a + elem]);
        }
    }

    #[test]
    fn copy_matches_reference_on_partial_boxes() {
        let ss = Slice::new(&[(1, 3), (0, 4), (2, 3)]);
        let ds = Slice::new(&[(0, 3), (1, 2), (0, 5)]);
        let src: Vec<u8> = (0..ss.volume().unwrap() as usize * 2)
            .map(|i| i as u8)
            .collect();
        let mut got = vec![0u8; ds.volume().unwrap() as usize * 2];
        let mut want = got.clone();
        let n = copy_overlap(&src, &ss, &mut got, &ds, 2).unwrap();
        naive(&src, &ss, &mut want, &ds, 2);
        assert_eq!(n, 2 * 2 * 3);
        assert_eq!(got, want);
    }

    #[test]
    fn disjoint_and_scalar() {
        let a = Slice::new(&[(0, 2)]);
        let b = Slice::new(&[(2, 2)]);
        let mut dst = vec![7u8; 8];
        assert_eq!(copy_overlap(&[1; 8], &a, &mut dst, &b, 4).unwrap(), 0);
        assert_eq!(dst, vec![7u8; 8]);
        let s = Slice::new(&[]);
        let mut one = [0u8; 4];
        assert_eq!(copy_overlap(&[9; 4], &s, &mut one, &s, 4).unwrap(), 1);
        assert_eq!(one, [9; 4]);
    }

    #[test]
    fn rank_mismatch_is_refused() {
        let (a, b) = (Slice::new(&[(0, 2)]), Slice::new(&[(0, 1), (0, 2)]));
        let err = copy_overlap(&[0; 2], &a, &mut [0; 2], &b, 1).unwrap_err();
        assert!(matches!(err, CkptError::RankMismatch { .. }));
    }

    #[test]
    fn wrong_buffer_length_is_refused() {
        let s = Slice::new(&[(0, 3)]);
        let err = copy_overlap(&[0; 5], &s, &mut [0; 12], &s, 4).unwrap_err();
        assert!(matches!(
            err,
            CkptError::BufferSize {
                expected: 12,
                actual: 5,
                ..
            }
        ));
    }

    #[test]
    fn absurd_sizes_are_refused() {
        let t = TensorMeta {
            name: "x".into(),
            dtype: DType::F32,
            shape: vec![1 << 40, 1 << 30],
        };
        assert!(matches!(t.byte_size(), Err(CkptError::SizeLimit { .. })));
    }
}
