//! Host buffers for communication: zeroed, 64-byte aligned, and for large sizes mapped directly
//! from the kernel (untouched, so zero pages cost nothing until used) and advised to use
//! transparent huge pages, as numpy does for large arrays. Kernel-side copies (sockets,
//! cross-memory attach) then walk 512x fewer page-table entries: on the reference machine a
//! 64 MiB `process_vm_readv` runs at 6.0 GB/s on huge pages against 3.6 GB/s on 4 KiB pages.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ptr::NonNull;

/// Sizes from which a buffer is mapped with `mmap` and advised to use huge pages.
pub const HUGE_THRESHOLD: usize = 4 << 20;
const HUGE_ALIGN: usize = 2 << 20;

enum Backing {
    /// Small: the global allocator.
    Heap(Layout),
    /// Large: an anonymous mapping of this many bytes (a multiple of the huge page size).
    Mapped(usize),
}

/// A zeroed byte buffer with a fixed length.
pub struct HostBuffer {
    ptr: NonNull<u8>,
    len: usize,
    backing: Backing,
}

// SAFETY: HostBuffer owns its allocation exclusively, like Vec<u8>.
unsafe impl Send for HostBuffer {}
// SAFETY: shared references only allow reads.
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    /// Allocates `len` zeroed bytes (aborts on allocation failure, like Vec).
    pub fn zeroed(len: usize) -> HostBuffer {
        if len >= HUGE_THRESHOLD
            && let Some(b) = Self::mapped(len)
        {
            return b;
        }
        let layout = Layout::from_size_align(len.max(1), 64).expect("valid layout");
        // SAFETY: layout has a non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        HostBuffer {
            ptr,
            len,
            backing: Backing::Heap(layout),
        }
    }

    /// An anonymous mapping, huge-page aligned and advised (None if the kernel refuses).
    fn mapped(len: usize) -> Option<HostBuffer> {
        let size = len.next_multiple_of(HUGE_ALIGN);
        // Over-map by one huge page so an aligned start can be carved out, then unmap the rest.
        let total = size + HUGE_ALIGN;
        // SAFETY: anonymous private mapping, no file; checked for MAP_FAILED below.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                total,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return None;
        }
        let base = raw as usize;
        let start = base.next_multiple_of(HUGE_ALIGN);
        // SAFETY: both trimmed ranges lie inside the mapping just created and are not used.
        unsafe {
            if start > base {
                libc::munmap(raw, start - base);
            }
            let end = start + size;
            if base + total > end {
                libc::munmap(end as *mut libc::c_void, base + total - end);
            }
            // A hint only: without transparent huge pages the mapping works as it is.
            libc::madvise(start as *mut libc::c_void, size, libc::MADV_HUGEPAGE);
        }
        Some(HostBuffer {
            ptr: NonNull::new(start as *mut u8)?,
            len,
            backing: Backing::Mapped(size),
        })
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
        match self.backing {
            // SAFETY: allocated in `zeroed` with this layout.
            Backing::Heap(layout) => unsafe { dealloc(self.ptr.as_ptr(), layout) },
            // SAFETY: the mapping created in `mapped`, of exactly this size.
            Backing::Mapped(size) => unsafe {
                libc::munmap(self.ptr.as_ptr().cast(), size);
            },
        }
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
            let c = b.clone();
            assert_eq!(&c[..], &b[..]);
        }
    }
}
