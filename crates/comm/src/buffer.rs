//! Host buffers for communication: zeroed, 64-byte aligned, and for large sizes 2 MiB aligned
//! and advised to use transparent huge pages (as numpy does for large arrays), which makes
//! kernel-side copies (sockets, cross-memory attach) walk 512x fewer page-table entries.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ptr::NonNull;

/// Sizes from which a buffer is huge-page aligned and advised.
pub const HUGE_THRESHOLD: usize = 4 << 20;
const HUGE_ALIGN: usize = 2 << 20;

/// A zeroed byte buffer with a fixed length.
pub struct HostBuffer {
    ptr: NonNull<u8>,
    len: usize,
    layout: Layout,
}

// SAFETY: HostBuffer owns its allocation exclusively, like Vec<u8>.
unsafe impl Send for HostBuffer {}
// SAFETY: shared references only allow reads.
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    /// Allocates `len` zeroed bytes (aborts on allocation failure, like Vec).
    pub fn zeroed(len: usize) -> HostBuffer {
        let align = if len >= HUGE_THRESHOLD {
            HUGE_ALIGN
        } else {
            64
        };
        let layout = Layout::from_size_align(len.max(1).next_multiple_of(align), align)
            .expect("valid layout");
        // SAFETY: layout has a non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        if align == HUGE_ALIGN {
            // SAFETY: the range is our own allocation; the advice is only a hint.
            unsafe { libc::madvise(raw.cast(), layout.size(), libc::MADV_HUGEPAGE) };
        }
        HostBuffer { ptr, len, layout }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl std::ops::Deref for HostBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr is valid for len initialised (zeroed) bytes for our lifetime.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for HostBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in deref, and we hold the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl From<&[u8]> for HostBuffer {
    fn from(v: &[u8]) -> HostBuffer {
        let mut c = HostBuffer::zeroed(v.len());
        c.copy_from_slice(v);
        c
    }
}

impl Clone for HostBuffer {
    fn clone(&self) -> HostBuffer {
        HostBuffer::from(&self[..])
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this layout.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeroed_aligned_and_writable() {
        for len in [0, 1, 100, HUGE_THRESHOLD + 3] {
            let mut b = HostBuffer::zeroed(len);
            assert_eq!(b.len(), len);
            assert!(b.iter().all(|&x| x == 0));
            if len > 0 {
                b[len - 1] = 7;
                assert_eq!(b[len - 1], 7);
            }
            let align = if len >= HUGE_THRESHOLD {
                HUGE_ALIGN
            } else {
                64
            };
            assert_eq!(b.as_ptr() as usize % align, 0);
        }
    }
}
