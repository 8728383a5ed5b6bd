//! The KV checksum: its definition, a slow reference implementation, and the comparison rules.
//!
//! A block's checksum is computed over the logical, unsharded view of the block: for each layer
//! `l` and KV head `h`, the K and V bytes of each token `t` (K then V, `2 * head_dim * element
//! bytes` in all; an MLA cache's one latent vector, `head_dim * element bytes`, in their place),
//! read as little-endian u64 pieces, `P` pieces per token. Piece `p` of the token
//! at absolute position `t` in the request has index `j = t*P + p` and weight `m * (2j + 1)`, with
//! `m = 2*(l*65536 + h) + 1`. Sums wrap modulo 2^64. Tokens at or past the request's token count
//! count as zero.
//!
//! Because `j` uses the absolute position, the checksums of consecutive blocks add up to the
//! checksum of a larger block holding the same tokens, whatever the block size; swapping blocks
//! changes the sum. The agent's fast implementation lives in pdpair-agent; this module is the
//! definition both sides are tested against.

use serde::{Deserialize, Serialize};

/// The dimensions the checksum needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shape {
    /// Layers.
    pub layers: u32,
    /// KV heads (of the logical, unsharded model).
    pub heads: u32,
    /// Elements per head.
    pub head_dim: u32,
    /// Bytes per element.
    pub element_bytes: u32,
    /// An MLA cache: a token holds one latent vector of `head_dim` elements, no separate V.
    #[serde(default)]
    pub latent: bool,
}

impl Shape {
    /// K and V (2), or MLA's one latent vector (1), per token of a head.
    pub fn halves(&self) -> usize {
        if self.latent { 1 } else { 2 }
    }

    /// Bytes of one token of one head in one layer: its K then its V (MLA: its latent).
    pub fn token_bytes(&self) -> usize {
        self.halves() * self.head_dim as usize * self.element_bytes as usize
    }

    /// u64 pieces per token (`P`), or `None` when a token is not a whole number of pieces.
    pub fn pieces_per_token(&self) -> Option<u64> {
        let bytes = self.token_bytes();
        (bytes > 0 && bytes.is_multiple_of(8)).then_some((bytes / 8) as u64)
    }

    /// Bytes of one block in the canonical layout (per layer, per head, per token: K then V, or the latent).
    pub fn canonical_block_bytes(&self, block_size: u32) -> usize {
        self.layers as usize * self.heads as usize * block_size as usize * self.token_bytes()
    }
}

/// The per-(layer, head) multiplier `m = 2*(l*65536 + h) + 1`.
pub fn head_multiplier(layer: u32, head: u32) -> u64 {
    2u64.wrapping_mul(u64::from(layer).wrapping_mul(65536).wrapping_add(u64::from(head)))
        .wrapping_add(1)
}

/// The reference checksum of one block in the canonical layout, written to follow the
/// definition word for word (slow on purpose: tests compare fast code against it).
///
/// `first_token` is the absolute position of the block's first token; tokens at or past
/// `num_tokens` count as zero. Returns `None` when the shape has no whole pieces per token or the
/// buffer is not one block long.
pub fn reference_block(shape: &Shape, block: &[u8], block_size: u32, first_token: u64, num_tokens: u64) -> Option<u64> {
    let pieces = shape.pieces_per_token()?;
    if block.len() != shape.canonical_block_bytes(block_size) {
        return None;
    }
    let token_bytes = shape.token_bytes();
    let mut sum = 0u64;
    let mut offset = 0usize;
    for l in 0..shape.layers {
        for h in 0..shape.heads {
            let m = head_multiplier(l, h);
            for i in 0..u64::from(block_size) {
                let t = first_token + i;
                let token = &block[offset..offset + token_bytes];
                offset += token_bytes;
                if t >= num_tokens {
                    continue;
                }
                for p in 0..pieces {
                    let at = (p * 8) as usize;
                    let mut le = [0u8; 8];
                    le.copy_from_slice(&token[at..at + 8]);
                    let x = u64::from_le_bytes(le);
                    let j = t.wrapping_mul(pieces).wrapping_add(p);
                    let weight = m.wrapping_mul(j.wrapping_mul(2).wrapping_add(1));
                    sum = sum.wrapping_add(x.wrapping_mul(weight));
                }
            }
        }
    }
    Some(sum)
}

/// Checksums of consecutive blocks of one side of a transfer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockSums {
    /// Tokens per block.
    pub block_size: u32,
    /// Absolute position of the first block's first token.
    pub first_token: u64,
    /// One checksum per block, in order.
    pub sums: Vec<u64>,
}

impl BlockSums {
    /// Sums of whole chunks of `chunk` tokens on a grid starting at `origin`, keyed by the chunk's
    /// first token. A chunk is present only when this side's blocks cover it exactly.
    fn chunks(&self, chunk: u64, origin: u64) -> Vec<(u64, u64)> {
        let size = u64::from(self.block_size);
        if size == 0 || !chunk.is_multiple_of(size) {
            return Vec::new();
        }
        let per = (chunk / size) as usize;
        let mut out = Vec::new();
        let mut i = 0usize;
        while i < self.sums.len() {
            // A peer's `first_token`: saturating, never overflowing (a panic in a debug build).
            let start = self.first_token.saturating_add((i as u64).saturating_mul(size));
            if start < origin || !(start - origin).is_multiple_of(chunk) {
                i += 1; // not on the grid: this block starts inside a chunk
                continue;
            }
            if i + per > self.sums.len() {
                break;
            }
            let sum = self.sums[i..i + per].iter().fold(0u64, |a, b| a.wrapping_add(*b));
            out.push((start, sum));
            i += per;
        }
        out
    }
}

/// What a comparison found, in chunks of the larger block size.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Comparison {
    /// Chunks both sides cover whole with the same tokens, and whose sums agree.
    pub verified: u64,
    /// Such chunks whose sums differ.
    pub mismatched: u64,
    /// The consumer's chunks (or blocks) that could not be compared.
    pub unverified: u64,
}

/// The verdict for a whole load.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    /// Every chunk verified.
    Verified,
    /// At least one chunk mismatched.
    Mismatched,
    /// Nothing mismatched, but something could not be verified.
    Unverified,
}

impl Comparison {
    /// The load's verdict.
    pub fn outcome(&self) -> Outcome {
        if self.mismatched > 0 {
            Outcome::Mismatched
        } else if self.unverified > 0 || self.verified == 0 {
            Outcome::Unverified
        } else {
            Outcome::Verified
        }
    }
}

/// Compares the producer's block sums with the consumer's.
///
/// The side with smaller blocks sums them into chunks of the larger block size; a chunk is
/// compared only where both sides cover it whole with the same tokens. Block sizes that are not
/// multiples of each other, and a consumer whose first loaded block starts inside a producer
/// block, are unverified, never verified.
pub fn compare(producer: &BlockSums, consumer: &BlockSums) -> Comparison {
    let (ps, cs) = (u64::from(producer.block_size), u64::from(consumer.block_size));
    let consumer_blocks = consumer.sums.len() as u64;
    if ps == 0 || cs == 0 || !ps.max(cs).is_multiple_of(ps.min(cs)) {
        return Comparison {
            unverified: consumer_blocks,
            ..Comparison::default()
        };
    }
    let chunk = ps.max(cs);
    // The consumer must start on a producer block boundary.
    let starts_inside = consumer.first_token < producer.first_token
        || !(consumer.first_token - producer.first_token).is_multiple_of(ps);
    if starts_inside {
        return Comparison {
            unverified: consumer_blocks.div_ceil(chunk / cs),
            ..Comparison::default()
        };
    }
    // Chunks lie on the grid of the side with the larger blocks.
    let origin = if ps >= cs {
        producer.first_token
    } else {
        consumer.first_token
    };
    let produced = producer.chunks(chunk, origin);
    let consumed = consumer.chunks(chunk, origin);
    let mut out = Comparison::default();
    for (start, sum) in &consumed {
        match produced.iter().find(|(s, _)| s == start) {
            Some((_, p)) if p == sum => out.verified += 1,
            Some(_) => out.mismatched += 1,
            None => out.unverified += 1,
        }
    }
    // Consumer blocks that fall in no whole chunk.
    let covered = consumed.len() as u64 * (chunk / cs);
    out.unverified += (consumer_blocks.saturating_sub(covered)).div_ceil(chunk / cs);
    out
}

/// [`compare`] for one request of `num_tokens` tokens: producer blocks the producer did not send
/// because they start at or past the last token hold no tokens, and by the definition sum to
/// zero; they are filled in, so a consumer block covering the request's end compares whole.
pub fn compare_request(producer: &BlockSums, consumer: &BlockSums, num_tokens: u64) -> Comparison {
    let size = u64::from(producer.block_size);
    let end = consumer
        .first_token
        .saturating_add((consumer.sums.len() as u64).saturating_mul(u64::from(consumer.block_size)));
    let mut padded = producer.clone();
    if size > 0 {
        loop {
            let next = padded
                .first_token
                .saturating_add((padded.sums.len() as u64).saturating_mul(size));
            if next >= end || next < num_tokens {
                break;
            }
            padded.sums.push(0);
        }
    }
    compare(&padded, consumer)
}

#[cfg(test)]
mod tests;
