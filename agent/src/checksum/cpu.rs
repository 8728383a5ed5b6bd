//! The fast CPU KV checksum, computed straight from an engine's physical block layout.
//!
//! Same definition as `pdpair_api::checksum` (the reference it is tested against): for each layer
//! and (global) KV head, every token's K then V bytes (an MLA cache's latent vector alone) as little-endian u64 pieces, piece `j` of
//! the request weighted `m * (2j + 1)`. The inner loop keeps one wrapping accumulator per
//! (layer, head) and multiplies by `m` once, so it costs one multiply and two adds per 8 bytes.

use pdpair_api::{
    KvLayout,
    checksum::{Shape, head_multiplier},
};

/// Where one block's bytes are, for the checksum.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockLayout {
    /// The canonical dump: per layer, per head, per token, K then V.
    Canonical,
    /// An engine block: per layer a K block then (elsewhere) a V block, each HND or NHD.
    Engine(KvLayout),
}

/// The checksum of one block given a function that returns, for (layer, local head, token in
/// block), that token's K bytes and V bytes (for an MLA shape, the latent and an empty slice).
///
/// `head_offset` is the global index of local head 0 (a tensor-parallel rank's first head), so
/// sharded engines sum to the logical, unsharded checksum.
#[inline]
pub fn block_checksum<'a, F>(
    shape: &Shape,
    head_offset: u32,
    block_size: u32,
    first_token: u64,
    num_tokens: u64,
    token: F,
) -> Option<u64>
where
    F: Fn(u32, u32, u32) -> (&'a [u8], &'a [u8]),
{
    let pieces = shape.pieces_per_token()?;
    let half = shape.head_dim as usize * shape.element_bytes as usize;
    let whole_halves = half.is_multiple_of(8);
    let live = num_tokens.saturating_sub(first_token).min(u64::from(block_size)) as u32;
    let mut sum = 0u64;
    let mut scratch = vec![0u8; shape.token_bytes()];
    for l in 0..shape.layers {
        for h in 0..shape.heads {
            let mut acc = 0u64;
            for i in 0..live {
                let t = first_token + u64::from(i);
                let mut w = t.wrapping_mul(pieces).wrapping_mul(2).wrapping_add(1);
                let (k, v) = token(l, h, i);
                if whole_halves {
                    // sum_p x_p (w + 2p) = w * sum x_p + 2 * sum p x_p, over K then V (V's
                    // pieces continue K's indices).
                    let (k0, k1) = piece_sums(k);
                    let (v0, v1) = piece_sums(v);
                    let n_k = (k.len() / 8) as u64;
                    let s0 = k0.wrapping_add(v0);
                    let s1 = k1.wrapping_add(v1).wrapping_add(n_k.wrapping_mul(v0));
                    acc = acc.wrapping_add(w.wrapping_mul(s0)).wrapping_add(s1.wrapping_mul(2));
                } else {
                    // A piece straddles K and V: join them first (rare shapes only).
                    // (k and v are exactly `half` bytes each; an MLA shape's v is empty.)
                    scratch[..k.len()].copy_from_slice(k);
                    scratch[k.len()..k.len() + v.len()].copy_from_slice(v);
                    for piece in scratch.chunks_exact(8) {
                        let x = u64::from_le_bytes(piece.try_into().unwrap_or([0; 8]));
                        acc = acc.wrapping_add(x.wrapping_mul(w));
                        w = w.wrapping_add(2);
                    }
                }
            }
            sum = sum.wrapping_add(acc.wrapping_mul(head_multiplier(l, head_offset + h)));
        }
    }
    Some(sum)
}

/// Over the little-endian u64 pieces `x_p` of `bytes` (a whole number of them): (`sum x_p`,
/// `sum p * x_p`), wrapping. Multiply-free in the loop, so it vectorises: four lanes keep running
/// sums `a` (of the pieces) and `b` (of `a`), and `sum_k k * v_k = n * a - b` per lane.
#[inline]
fn piece_sums(bytes: &[u8]) -> (u64, u64) {
    const LANES: usize = 4;
    let mut a = [0u64; LANES];
    let mut b = [0u64; LANES];
    let chunks = bytes.chunks_exact(8 * LANES);
    let tail = chunks.remainder();
    let n = chunks.len() as u64;
    for chunk in chunks {
        for l in 0..LANES {
            let x = u64::from_le_bytes(chunk[8 * l..8 * l + 8].try_into().unwrap_or([0; 8]));
            a[l] = a[l].wrapping_add(x);
            b[l] = b[l].wrapping_add(a[l]);
        }
    }
    let (mut s0, mut s1) = (0u64, 0u64);
    for l in 0..LANES {
        // Lane l holds pieces p = LANES * k + l.
        let weighted = n.wrapping_mul(a[l]).wrapping_sub(b[l]); // sum_k k * v_k[l]
        s0 = s0.wrapping_add(a[l]);
        s1 = s1
            .wrapping_add(weighted.wrapping_mul(LANES as u64))
            .wrapping_add((l as u64).wrapping_mul(a[l]));
    }
    let first = n * LANES as u64;
    for (i, piece) in tail.chunks_exact(8).enumerate() {
        let x = u64::from_le_bytes(piece.try_into().unwrap_or([0; 8]));
        s0 = s0.wrapping_add(x);
        s1 = s1.wrapping_add(x.wrapping_mul(first + i as u64));
    }
    (s0, s1)
}

/// Checksums of the consecutive blocks of a canonical dump whose first token is `first_token`.
pub fn canonical_dump(
    shape: &Shape,
    block_size: u32,
    first_token: u64,
    num_tokens: u64,
    dump: &[u8],
) -> Option<Vec<u64>> {
    let block_bytes = shape.canonical_block_bytes(block_size);
    if block_bytes == 0 || !dump.len().is_multiple_of(block_bytes) {
        return None;
    }
    let tb = shape.token_bytes();
    let half = shape.head_dim as usize * shape.element_bytes as usize;
    dump.chunks_exact(block_bytes)
        .enumerate()
        .map(|(b, block)| {
            let first = first_token + b as u64 * u64::from(block_size);
            block_checksum(shape, 0, block_size, first, num_tokens, |l, h, i| {
                let at = ((l as usize * shape.heads as usize + h as usize) * block_size as usize + i as usize) * tb;
                (&block[at..at + half], &block[at + half..at + tb])
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use pdpair_api::checksum::reference_block;
    use proptest::prelude::*;

    use super::*;

    fn bytes(n: usize, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// The fast path equals the reference, for whole and straddling pieces, any first token
        /// and any token count.
        #[test]
        fn fast_equals_reference(
            seed in any::<u64>(),
            layers in 1u32..3,
            heads in 1u32..4,
            (head_dim, element_bytes) in prop::sample::select(vec![(4u32, 2u32), (8, 1), (2, 2), (64, 2), (4, 4), (16, 1)]),
            block_size in 1u32..9,
            latent in any::<bool>(),
            blocks in 1usize..4,
            first_token in 0u64..100,
            extra in 0u64..40,
        ) {
            let shape = Shape { layers, heads, head_dim, element_bytes, latent };
            // A latent token is one half: whole pieces only when the half is.
            prop_assume!(shape.pieces_per_token().is_some());
            let num_tokens = first_token + extra;
            let dump = bytes(shape.canonical_block_bytes(block_size) * blocks, seed);
            let fast = canonical_dump(&shape, block_size, first_token, num_tokens, &dump).expect("whole blocks");
            for (b, block) in dump.chunks_exact(shape.canonical_block_bytes(block_size)).enumerate() {
                let first = first_token + b as u64 * u64::from(block_size);
                let slow = reference_block(&shape, block, block_size, first, num_tokens).expect("valid");
                prop_assert_eq!(fast[b], slow);
            }
        }
    }

    #[test]
    fn rejects_partial_dumps_and_bad_shapes() {
        let shape = Shape {
            layers: 1,
            heads: 1,
            head_dim: 4,
            element_bytes: 2,
            latent: false,
        };
        assert!(canonical_dump(&shape, 2, 0, 2, &[0u8; 31]).is_none());
        let odd = Shape {
            head_dim: 2,
            element_bytes: 1,
            ..shape
        };
        assert!(canonical_dump(&odd, 2, 0, 2, &[0u8; 8]).is_none());
    }
}
