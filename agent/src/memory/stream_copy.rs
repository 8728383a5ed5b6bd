//! Copies into memory this process will not read again soon (a peer's KV landing in an engine's
//! pool, read by the engine, and by the agent's checksums only once the whole request landed): non-temporal stores on x86_64, so the destination's lines are neither read first
//! (read-for-ownership) nor left in the cache, where they would push out the record buffers the
//! stream reuses. Elsewhere a plain copy.
#![allow(unsafe_code)]

/// Copies `src` to `dst`, bypassing the cache where the CPU can.
///
/// # Safety
/// `dst..dst+src.len()` must be valid for writes and not overlap `src`.
pub unsafe fn copy_streaming(dst: *mut u8, src: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: the caller's guarantee, passed on; SSE2 is part of x86_64.
        unsafe { x86::copy(dst, src) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        // SAFETY: the caller's guarantee, passed on.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};

    /// Below this a plain copy: the fence and the alignment cost more than they save.
    const MIN: usize = 4096;

    pub unsafe fn copy(dst: *mut u8, src: &[u8]) {
        let len = src.len();
        if len < MIN {
            // SAFETY: the caller's guarantee.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, len) };
            return;
        }
        // A plain copy up to dst's first cache line boundary, then a line a step in streaming
        // stores (whole lines: the CPU's write-combining buffers go out full), then a plain
        // copy of the tail.
        let head = dst.align_offset(64).min(len);
        // SAFETY: within both ranges (head <= len).
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, head) };
        let mut at = head;
        while at + 64 <= len {
            // SAFETY: at+64 <= len, so the loads lie in `src` and the stores in `dst`;
            // `dst + at` is 64-byte aligned (head aligned it, steps are 64); loads are
            // unaligned.
            unsafe {
                let s = src.as_ptr().add(at).cast::<__m128i>();
                let d = dst.add(at).cast::<__m128i>();
                let (a, b, c, e) = (
                    _mm_loadu_si128(s),
                    _mm_loadu_si128(s.add(1)),
                    _mm_loadu_si128(s.add(2)),
                    _mm_loadu_si128(s.add(3)),
                );
                _mm_stream_si128(d, a);
                _mm_stream_si128(d.add(1), b);
                _mm_stream_si128(d.add(2), c);
                _mm_stream_si128(d.add(3), e);
            }
            at += 64;
        }
        // SAFETY: the tail lies in both ranges. The fence orders the streaming stores before
        // whatever this thread does next (a flush's answer, a lock's release).
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr().add(at), dst.add(at), len - at);
            _mm_sfence();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::copy_streaming;

    #[test]
    fn every_byte_lands_at_every_alignment_and_length_and_nothing_around_it() {
        let src: Vec<u8> = (0..70_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        for (dst_off, src_off, len) in [
            (0, 0, 0),
            (1, 0, 1),
            (3, 5, 4095),
            (0, 0, 4096),
            (7, 1, 4097),
            (16, 3, 65_536),
            (9, 13, 65_600),
            (15, 2, 69_000),
        ] {
            let mut dst = vec![0xAAu8; 70_100];
            // SAFETY: dst_off + len <= dst.len(); separate vectors.
            unsafe { copy_streaming(dst.as_mut_ptr().add(dst_off), &src[src_off..src_off + len]) };
            assert_eq!(
                &dst[dst_off..dst_off + len],
                &src[src_off..src_off + len],
                "{dst_off} {src_off} {len}"
            );
            assert!(
                dst[..dst_off].iter().all(|b| *b == 0xAA),
                "bytes before, {dst_off} {len}"
            );
            assert!(
                dst[dst_off + len..].iter().all(|b| *b == 0xAA),
                "bytes after, {dst_off} {len}"
            );
        }
    }
}
