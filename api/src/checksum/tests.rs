use proptest::prelude::*;

use super::*;

/// Token bytes for (layer, head, token): a deterministic pseudo-random function.
fn token(shape: &Shape, seed: u64, l: u32, h: u32, t: u64) -> Vec<u8> {
    let mut x = seed ^ (u64::from(l) << 48) ^ (u64::from(h) << 32) ^ t.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (0..shape.token_bytes())
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// One block in the canonical layout, tokens `first..first+block_size`.
fn canonical(shape: &Shape, seed: u64, block_size: u32, first: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(shape.canonical_block_bytes(block_size));
    for l in 0..shape.layers {
        for h in 0..shape.heads {
            for i in 0..u64::from(block_size) {
                out.extend(token(shape, seed, l, h, first + i));
            }
        }
    }
    out
}

fn sums(shape: &Shape, seed: u64, block_size: u32, first: u64, blocks: usize, num_tokens: u64) -> BlockSums {
    let sums = (0..blocks)
        .map(|b| {
            let start = first + b as u64 * u64::from(block_size);
            let bytes = canonical(shape, seed, block_size, start);
            reference_block(shape, &bytes, block_size, start, num_tokens).expect("valid shape")
        })
        .collect();
    BlockSums {
        block_size,
        first_token: first,
        sums,
    }
}

const SHAPE: Shape = Shape {
    layers: 2,
    heads: 3,
    head_dim: 8,
    element_bytes: 2,
    latent: false,
};

#[test]
fn pieces_per_token() {
    assert_eq!(SHAPE.pieces_per_token(), Some(4));
    assert_eq!(
        Shape {
            head_dim: 2,
            element_bytes: 1,
            ..SHAPE
        }
        .pieces_per_token(),
        None
    );
    assert_eq!(
        Shape {
            head_dim: 2,
            element_bytes: 2,
            ..SHAPE
        }
        .pieces_per_token(),
        Some(1)
    );
    assert_eq!(head_multiplier(0, 0), 1);
    assert_eq!(head_multiplier(1, 2), 2 * (65536 + 2) + 1);
}

#[test]
fn one_piece_by_hand() {
    // One layer, one head, one token of 8 bytes (head_dim 2, fp16): x * m * (2j+1) with j = t*1.
    let shape = Shape {
        layers: 1,
        heads: 1,
        head_dim: 2,
        element_bytes: 2,
        latent: false,
    };
    let block = 5u64.to_le_bytes();
    assert_eq!(reference_block(&shape, &block, 1, 0, 10), Some(5));
    assert_eq!(reference_block(&shape, &block, 1, 3, 10), Some(5 * 7));
    assert_eq!(
        reference_block(&shape, &block, 1, 3, 3),
        Some(0),
        "past num_tokens counts as zero"
    );
    assert_eq!(reference_block(&shape, &block[..4], 1, 0, 10), None, "wrong length");
}

#[test]
fn swapping_blocks_changes_the_sum() {
    let a = canonical(&SHAPE, 1, 4, 0);
    let b = canonical(&SHAPE, 1, 4, 4);
    let sum = |x: &[u8], y: &[u8]| {
        let first = reference_block(&SHAPE, x, 4, 0, 100).expect("ok");
        first.wrapping_add(reference_block(&SHAPE, y, 4, 4, 100).expect("ok"))
    };
    let (straight, swapped) = (sum(&a, &b), sum(&b, &a));
    assert_ne!(straight, swapped);
}

#[test]
fn offset_formula_from_the_design() {
    // A block starting at token f sums x*w + f*x*(2*P*m): its sum at 0 plus f*2P*sum(m*x).
    let shape = Shape {
        layers: 1,
        heads: 2,
        head_dim: 4,
        element_bytes: 2,
        latent: false,
    };
    let block = canonical(&shape, 9, 4, 0);
    let at0 = reference_block(&shape, &block, 4, 0, u64::MAX).expect("ok");
    let f = 1000u64;
    let at_f = reference_block(&shape, &block, 4, f, u64::MAX).expect("ok");
    let p = shape.pieces_per_token().expect("whole pieces");
    let mut mx = 0u64;
    let mut offset = 0;
    for h in 0..2 {
        for _ in 0..4 * p {
            let mut le = [0u8; 8];
            le.copy_from_slice(&block[offset..offset + 8]);
            offset += 8;
            mx = mx.wrapping_add(head_multiplier(0, h).wrapping_mul(u64::from_le_bytes(le)));
        }
    }
    assert_eq!(at_f, at0.wrapping_add(f.wrapping_mul(2 * p).wrapping_mul(mx)));
}

#[test]
fn compare_same_and_larger_consumer_blocks() {
    let p = sums(&SHAPE, 3, 16, 0, 4, 64);
    assert_eq!(compare(&p, &p.clone()).outcome(), Outcome::Verified);
    let c = sums(&SHAPE, 3, 32, 0, 2, 64);
    let r = compare(&p, &c);
    assert_eq!((r.verified, r.mismatched, r.unverified), (2, 0, 0));
    // Consumer smaller than producer: sums into producer-size chunks.
    let r = compare(&c, &p);
    assert_eq!((r.verified, r.mismatched, r.unverified), (2, 0, 0));
}

#[test]
fn compare_detects_a_changed_block() {
    let p = sums(&SHAPE, 3, 16, 0, 4, 64);
    let mut c = sums(&SHAPE, 3, 32, 0, 2, 64);
    c.sums[1] = c.sums[1].wrapping_add(1);
    let r = compare(&p, &c);
    assert_eq!((r.verified, r.mismatched), (1, 1));
    assert_eq!(r.outcome(), Outcome::Mismatched);
}

#[test]
fn compare_unverified_cases() {
    // Sizes that are not multiples of each other.
    let p = sums(&SHAPE, 3, 16, 0, 3, 48);
    let c = sums(&SHAPE, 3, 24, 0, 2, 48);
    assert_eq!(compare(&p, &c).outcome(), Outcome::Unverified);
    // A consumer whose first block starts inside a producer block.
    let p = sums(&SHAPE, 3, 32, 0, 2, 64);
    let c = sums(&SHAPE, 3, 16, 16, 3, 64);
    let r = compare(&p, &c);
    assert_eq!(r.outcome(), Outcome::Unverified);
    assert_eq!(r.verified, 0);
    // A trailing consumer block not covered whole by the producer.
    let p = sums(&SHAPE, 3, 16, 0, 2, 64);
    let c = sums(&SHAPE, 3, 32, 0, 2, 64);
    let r = compare(&p, &c);
    assert_eq!((r.verified, r.unverified), (1, 1));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Consecutive blocks add up to the larger block holding the same tokens, whatever the block
    /// size, including a partial last block.
    #[test]
    fn sums_add_up_across_block_sizes(
        seed in any::<u64>(),
        small in prop::sample::select(vec![1u32, 2, 4, 8]),
        ratio in 1u32..5,
        first_block in 0u64..6,
        num_tokens in 0u64..200,
    ) {
        let large = small * ratio;
        let first = first_block * u64::from(large);
        let big = reference_block(&SHAPE, &canonical(&SHAPE, seed, large, first), large, first, num_tokens).expect("ok");
        let parts = (0..ratio).fold(0u64, |acc, k| {
            let start = first + u64::from(k * small);
            let block = canonical(&SHAPE, seed, small, start);
            acc.wrapping_add(reference_block(&SHAPE, &block, small, start, num_tokens).expect("ok"))
        });
        prop_assert_eq!(big, parts);
    }

    /// Any single flipped byte inside the request's tokens changes the sum.
    #[test]
    fn a_flipped_byte_changes_the_sum(seed in any::<u64>(), at in 0usize..(2 * 3 * 4 * 32), bit in 0u8..8) {
        let block = canonical(&SHAPE, seed, 4, 0);
        let mut flipped = block.clone();
        flipped[at] ^= 1 << bit;
        let a = reference_block(&SHAPE, &block, 4, 0, 4).expect("ok");
        let b = reference_block(&SHAPE, &flipped, 4, 0, 4).expect("ok");
        prop_assert_ne!(a, b);
    }
}

#[test]
fn blocks_past_the_last_token_count_as_zero_in_a_request_comparison() {
    // 100 tokens: the producer sends 7 blocks of 16 (the last holds tokens 96..100); the consumer
    // holds 4 blocks of 32, the last covering 96..128. The producer's missing block 112..128
    // holds no tokens, so it sums to zero and the last chunk still compares whole.
    let p = sums(&SHAPE, 5, 16, 0, 7, 100);
    let c = sums(&SHAPE, 5, 32, 0, 4, 100);
    assert_eq!(
        compare(&p, &c).outcome(),
        Outcome::Unverified,
        "plain compare cannot know"
    );
    let r = compare_request(&p, &c, 100);
    assert_eq!((r.verified, r.mismatched, r.unverified), (4, 0, 0));
    // A real gap (a block holding tokens is missing) stays unverified.
    let short = sums(&SHAPE, 5, 16, 0, 5, 100);
    assert_eq!(compare_request(&short, &c, 100).outcome(), Outcome::Unverified);
}

#[test]
fn a_peers_sums_at_any_position_compare_without_overflowing() {
    // The producer's sums come from a peer, first_token and block size as it chose them: near
    // u64::MAX the positions overflowed (a panic in a debug build, on decode's link reader).
    let c = sums(&SHAPE, 5, 32, 0, 4, 100);
    for (first_token, block_size) in [(u64::MAX - 1, 16), (u64::MAX - 40, 32), (1 << 63, u32::MAX)] {
        let p = BlockSums {
            block_size,
            first_token,
            sums: vec![1; 8],
        };
        assert_eq!(compare_request(&p, &c, 100).outcome(), Outcome::Unverified);
        assert_eq!(compare(&c, &p).outcome(), Outcome::Unverified);
    }
}
