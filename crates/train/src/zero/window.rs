//! A flat f32 buffer whose pages can be handed back to the kernel.
//!
//! ZeRO-2 frees each gradient bucket once it has been reduce-scattered and ZeRO-3 also frees
//! each unit's gathered parameters once its forward or backward is done (000 "ZeRO 与 FSDP";
//! FSDP frees its unsharded flat parameter the same way). The buffer is one anonymous private
//! mapping the size of the whole model: [`release`] hands a range's whole pages back
//! (`madvise(MADV_DONTNEED)`) and zeroes the elements on the partial pages at its ends, so a
//! released range reads as zeros and costs no memory until written again; [`Window::populate`]
//! makes a range resident again in one call just before it is rewritten (one system call
//! instead of a page fault per 4 KiB page: about 18,000 faults per rank per step for ZeRO-3 on
//! the tiny config; 0-4 % of its step in three interleaved pairs). The model's kernels
//! keep addressing parameters and gradients at their layout offsets in one flat buffer, and
//! only the pages in use are resident: [`Window::resident_bytes`] counts them (`mincore`).

use std::ops::{Deref, DerefMut, Range};

use memmap2::MmapMut;

use crate::error::{Result, TrainError};

/// A flat f32 buffer over an anonymous mapping (see the module doc).
pub struct Window {
    map: MmapMut,
    len: usize,
}

/// Bytes of one page.
fn page() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 { p as usize } else { 4096 }
}

impl Window {
    /// `len` zeros, none of them resident yet.
    pub fn new(len: usize) -> Result<Window> {
        let bytes = len
            .checked_mul(4)
            .ok_or_else(|| TrainError::Config {
                field: "buffer length",
                value: len.to_string(),
                reason: "too large".into(),
            })?
            .max(1);
        let map = MmapMut::map_anon(bytes).map_err(|e| TrainError::Config {
            field: "buffer",
            value: format!("{bytes} bytes"),
            reason: format!("cannot map it: {e}"),
        })?;
        Ok(Window { map, len })
    }

    /// A window holding a copy of `values`.
    pub fn from_slice(values: &[f32]) -> Result<Window> {
        let mut w = Window::new(values.len())?;
        w.copy_from_slice(values);
        Ok(w)
    }

    /// Zeroes `range` and hands its whole pages back to the kernel.
    pub fn release(&mut self, range: Range<usize>) {
        release(&mut self[range]);
    }

    /// Makes the whole pages of `range` resident in one call (`MADV_POPULATE_WRITE`), instead
    /// of one page fault per page on first write. A hint: where the kernel lacks it (before
    /// Linux 5.14) the pages fault in as they are written. Returns whether the kernel
    /// populated them (true for a range with no whole page).
    pub fn populate(&mut self, range: Range<usize>) -> bool {
        let (first, last) = whole_pages(&self[range]);
        if first >= last {
            return true;
        }
        // SAFETY: `first..last` lies inside this mapping; populating changes no contents.
        let rc = unsafe {
            libc::madvise(
                first as *mut libc::c_void,
                last - first,
                libc::MADV_POPULATE_WRITE,
            )
        };
        rc == 0
    }

    /// Bytes of this buffer now held in memory (whole pages; at most its length).
    pub fn resident_bytes(&self) -> usize {
        resident_bytes(&self.map).min(self.len * 4)
    }
}

impl Deref for Window {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        // SAFETY: the mapping is page-aligned (so f32-aligned), at least `len * 4` bytes long,
        // lives as long as `self`, and every bit pattern is a valid f32.
        unsafe { std::slice::from_raw_parts(self.map.as_ptr().cast::<f32>(), self.len) }
    }
}

impl DerefMut for Window {
    fn deref_mut(&mut self) -> &mut [f32] {
        // SAFETY: as in `deref`, and `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.map.as_mut_ptr().cast::<f32>(), self.len) }
    }
}

/// Zeroes `buf` and hands the whole pages inside it back to the kernel; the elements on the
/// partial pages at its ends are zeroed in place (their pages may hold a neighbour's data).
///
/// `buf` must lie in anonymous private memory (a [`Window`], or a heap allocation), where a
/// page given back with `MADV_DONTNEED` reads as zeros when next touched; on other memory the
/// whole slice is simply filled with zeros.
pub fn release(buf: &mut [f32]) {
    let start = buf.as_ptr() as usize;
    let (first, last) = whole_pages(buf);
    if first >= last {
        buf.fill(0.0);
        return;
    }
    let head = (first - start) / 4;
    let tail = (last - start) / 4;
    buf[..head].fill(0.0);
    buf[tail..].fill(0.0);
    // SAFETY: `first..last` is page-aligned and inside `buf`, which we borrow mutably, so no
    // one else reads it; on anonymous private memory DONTNEED makes those pages read as zeros,
    // which is the value this function writes.
    let rc = unsafe {
        libc::madvise(
            first as *mut libc::c_void,
            last - first,
            libc::MADV_DONTNEED,
        )
    };
    if rc != 0 {
        buf[head..tail].fill(0.0);
    }
}

/// Resident bytes of `map` (whole pages), from `mincore`.
fn resident_bytes(map: &MmapMut) -> usize {
    let p = page();
    let pages = map.len().div_ceil(p);
    let mut vec = vec![0u8; pages];
    // SAFETY: the mapping is page-aligned and `vec` has one byte per page of it.
    let rc = unsafe {
        libc::mincore(
            map.as_ptr() as *mut libc::c_void,
            map.len(),
            vec.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return map.len();
    }
    vec.iter().filter(|&&b| b & 1 == 1).count() * p
}

/// The addresses `first..last` of the whole pages inside `buf` (`first >= last`: none).
fn whole_pages(buf: &[f32]) -> (usize, usize) {
    let p = page();
    let start = buf.as_ptr() as usize;
    let end = start + std::mem::size_of_val(buf);
    (start.next_multiple_of(p), end / p * p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn released_ranges_read_zero_and_leave_memory() {
        let n = 1 << 20; // 4 MiB
        let mut w = Window::new(n).unwrap();
        assert!(w.resident_bytes() < 64 << 10, "{}", w.resident_bytes());
        w.iter_mut()
            .enumerate()
            .for_each(|(i, x)| *x = i as f32 + 1.0);
        assert!(w.resident_bytes() >= (n * 4) * 9 / 10);
        // An unaligned range: its interior pages go back, its ends are zeroed in place.
        let r = 1001..n - 777;
        w.release(r.clone());
        assert!(w.resident_bytes() <= 3 * page(), "{}", w.resident_bytes());
        assert!(w[r.clone()].iter().all(|&x| x == 0.0));
        assert_eq!(w[1000], 1001.0);
        assert_eq!(w[n - 777], (n - 776) as f32);
        // Writing again brings pages back.
        w[5000] = 7.0;
        assert_eq!(w[5000], 7.0);
        assert!(w.resident_bytes() >= page());
    }

    #[test]
    fn populating_a_released_range_makes_it_resident_and_keeps_the_values() {
        let n = 1 << 20; // 4 MiB
        let mut w = Window::from_slice(&vec![2.0; n]).unwrap();
        let r = 1001..n - 777;
        w.release(r.clone());
        assert!(w.resident_bytes() <= 3 * page(), "{}", w.resident_bytes());
        // Every whole page of the range is back (where the kernel can, Linux 5.14+), reading
        // the zeros it was left with; the elements outside it are untouched.
        if w.populate(r.clone()) {
            assert!(
                w.resident_bytes() >= (n * 4) * 9 / 10,
                "{}",
                w.resident_bytes()
            );
        }
        assert!(w[r.clone()].iter().all(|&x| x == 0.0));
        assert_eq!((w[1000], w[n - 777]), (2.0, 2.0));
        // An empty range and one inside a page are no-ops.
        assert!(w.populate(5..5) && w.populate(5..9));
        assert_eq!((w[5], w[2000]), (2.0, 0.0));
    }

    #[test]
    fn a_range_inside_one_page_is_zeroed() {
        let mut w = Window::from_slice(&[3.0; 100]).unwrap();
        w.release(10..20);
        assert!(w[10..20].iter().all(|&x| x == 0.0));
        assert_eq!((w[9], w[20]), (3.0, 3.0));
    }
}
