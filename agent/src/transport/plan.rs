//! A transfer's ops, planned as arithmetic and made as they are sent.
//!
//! A request's KV is one op per layer, array (K, V), block and head range; nothing bounds that
//! product by itself (an engine may declare 1024 layers and 1-token blocks), and built whole it
//! was a list of 24 bytes an op, copied again by the backends: about 1 GB for one insider's
//! request. A [`Plan`] holds only what the product is made of: each array's placement on both
//! sides, the request's blocks, and the pieces of a block that move ([`pieces`]: where the two
//! sides lay a block out alike, a piece is a block or a head range; where one side holds K and V
//! side by side and the other apart, a head's token). Its ops are made lazily
//! ([`Plan::ops`]), adjacent ones merged, and handed to the backend [`BATCH`] at a time
//! ([`in_batches`]), so a transfer's memory grows with its blocks, not with its ops.

use std::time::{Duration, Instant};

use super::{OpError, PutOp};

/// The most ops handed to a backend at once: 6 MiB of them (a backend keeps a few words more
/// per op while they are in flight). A backend's pipeline drains at the end of each batch (it
/// waits for the batch to land), so batches are long: with 65536 ops of 16 bytes over the tcp
/// stream, about what the socket buffers hold, a transfer took twice as long as one batch.
pub const BATCH: usize = 262144;

/// Where one layer's K (or V) array lies on both sides: its block 0 and the bytes from one
/// block to the next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Place {
    /// Our block 0.
    pub local: u64,
    /// Bytes between our blocks.
    pub local_stride: u64,
    /// The peer's block 0.
    pub remote: u64,
    /// Bytes between the peer's blocks.
    pub remote_stride: u64,
    /// Which of the plan's [`Pieces`] move of each of its blocks.
    pub set: usize,
}

/// What moves of each block of the arrays naming it, and how far apart the parts of our block
/// are.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Pieces {
    /// Bytes from one part of our block to the next.
    pub part_len: u64,
    /// What moves of each item.
    pub pieces: Vec<Piece>,
}

/// One block's move: our block, the part of it (`at` × the plan's part length, for a block
/// gathering several smaller peer blocks), and the peer's block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Item {
    /// Our block.
    pub local: u32,
    /// Which part of our block.
    pub at: u32,
    /// The peer's block.
    pub remote: u32,
}

/// A range that moves in every item: offsets into our part and the peer's block, and bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// Offset into our part of the block.
    pub local: u64,
    /// Offset into the peer's block.
    pub remote: u64,
    /// Bytes.
    pub len: u64,
}

/// Every array × item × piece, as arithmetic.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Each layer's arrays, in order.
    pub arrays: Vec<Place>,
    /// The blocks that move.
    pub items: Vec<Item>,
    /// The pieces the arrays name (one set where both sides lay out every layer alike).
    pub sets: Vec<Pieces>,
    /// Ops block by block, each block's arrays in turn, adjacent ones merged across arrays
    /// (where each side keeps its arrays in one region, a block's arrays nearer each other
    /// than one block to the next: vLLM 0.33's blocks-outermost layouts); else array by array.
    pub block_major: bool,
}

/// The most pieces of one block a plan takes (6 MiB of them): only two sides laying out a block
/// differently come near it (a piece per head and token), and an engine may declare huge blocks.
pub const MAX_PIECES: usize = 1 << 18;

/// One side's block as a plan sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockShape {
    /// Tokens in a block.
    pub tokens: u32,
    /// Heads in a block.
    pub heads: u32,
    /// Tokens outside heads (`NHD`), or heads outside tokens (`HND`).
    pub nhd: bool,
    /// Bytes from one head's one token to the next one's.
    pub unit: u64,
}

impl BlockShape {
    /// The offset of a head's token in the block.
    fn at(&self, head: u32, token: u32) -> u64 {
        let (h, t) = (u64::from(head), u64::from(token));
        if self.nhd {
            (t * u64::from(self.heads) + h) * self.unit
        } else {
            (h * u64::from(self.tokens) + t) * self.unit
        }
    }

    /// Bytes from one token to the next (the part length of a block gathering smaller ones).
    pub fn token_step(&self) -> u64 {
        if self.nhd {
            u64::from(self.heads) * self.unit
        } else {
            self.unit
        }
    }
}

/// The pieces moving the first `tokens` tokens of `count` heads, ours from `local_first` and the
/// peer's from `remote_first`, `len` bytes of each head's token, in our memory's order, adjacent
/// ones merged (two sides laid out alike: one piece, or one per head range). `Err` past
/// [`MAX_PIECES`] or outside either block.
pub fn pieces(
    local: &BlockShape,
    local_first: u32,
    remote: &BlockShape,
    remote_first: u32,
    count: u32,
    tokens: u32,
    len: u64,
) -> Result<Vec<Piece>, String> {
    let inside =
        |s: &BlockShape, first: u32| first.checked_add(count).is_some_and(|e| e <= s.heads) && tokens <= s.tokens;
    if !inside(local, local_first) || !inside(remote, remote_first) {
        return Err(format!(
            "heads {local_first}..+{count} and {tokens} tokens against blocks of {} heads x {} tokens here and {} x {} at the peer",
            local.heads, local.tokens, remote.heads, remote.tokens
        ));
    }
    let mut out: Vec<Piece> = Vec::new();
    let (outer, inner) = if local.nhd { (tokens, count) } else { (count, tokens) };
    for o in 0..outer {
        for i in 0..inner {
            let (h, t) = if local.nhd { (i, o) } else { (o, i) };
            let piece = Piece {
                local: local.at(local_first + h, t),
                remote: remote.at(remote_first + h, t),
                len,
            };
            if let Some(last) = out.last_mut()
                && last.local + last.len == piece.local
                && last.remote + last.len == piece.remote
            {
                last.len += len;
                continue;
            }
            if out.len() == MAX_PIECES {
                return Err(format!(
                    "a block moves in more than {MAX_PIECES} pieces (the two sides lay it out differently)"
                ));
            }
            out.push(piece);
        }
    }
    Ok(out)
}

impl Plan {
    /// The ops, array by array (adjacent ops of one array merged: never two arrays', which may
    /// lie in different regions that happen to touch), or block by block ([`Plan::block_major`]).
    pub fn ops(&self) -> Ops<'_> {
        Ops {
            plan: self,
            outer: 0,
            inner: 0,
            piece: 0,
            pending: None,
        }
    }

    /// The op at (array, item, piece); addresses saturate (a range that cannot be is refused by
    /// the backend's check of every op against the regions).
    fn op(&self, array: usize, item: usize, piece: usize) -> PutOp {
        let (a, i) = (self.arrays[array], self.items[item]);
        let set = &self.sets[a.set];
        let p = set.pieces[piece];
        PutOp {
            local: a
                .local
                .saturating_add(u64::from(i.local).saturating_mul(a.local_stride))
                .saturating_add(u64::from(i.at).saturating_mul(set.part_len))
                .saturating_add(p.local),
            len: p.len,
            remote: a
                .remote
                .saturating_add(u64::from(i.remote).saturating_mul(a.remote_stride))
                .saturating_add(p.remote),
        }
    }
}

/// [`Plan::ops`].
#[derive(Debug)]
pub struct Ops<'a> {
    plan: &'a Plan,
    /// Where the walk is: the array and the item (block), the outer of them first (items when
    /// the plan goes block by block), and the piece.
    outer: usize,
    inner: usize,
    piece: usize,
    /// The op being grown, and its array.
    pending: Option<(usize, PutOp)>,
}

impl Ops<'_> {
    /// The next op as planned, unmerged, with its array: every piece of every (array, item),
    /// arrays outermost, or items outermost where the plan goes block by block.
    fn raw(&mut self) -> Option<(usize, PutOp)> {
        let plan = self.plan;
        let (arrays, items) = (plan.arrays.len(), plan.items.len());
        let (outer_n, inner_n) = if plan.block_major {
            (items, arrays)
        } else {
            (arrays, items)
        };
        loop {
            if self.outer >= outer_n || inner_n == 0 {
                return None;
            }
            if self.inner >= inner_n {
                self.inner = 0;
                self.outer += 1;
                continue;
            }
            let (array, item) = if plan.block_major {
                (self.inner, self.outer)
            } else {
                (self.outer, self.inner)
            };
            // An array with nothing to move (or naming no set) has no pieces.
            let n = plan.sets.get(plan.arrays[array].set).map_or(0, |s| s.pieces.len());
            if self.piece >= n {
                self.piece = 0;
                self.inner += 1;
                continue;
            }
            let at = (array, plan.op(array, item, self.piece));
            self.piece += 1;
            return Some(at);
        }
    }
}

impl Iterator for Ops<'_> {
    type Item = PutOp;

    fn next(&mut self) -> Option<PutOp> {
        loop {
            let Some((array, op)) = self.raw() else {
                return self.pending.take().map(|(_, op)| op);
            };
            match &mut self.pending {
                Some((a, last))
                    if (*a == array || self.plan.block_major)
                        && last.local.checked_add(last.len) == Some(op.local)
                        && last.remote.checked_add(last.len) == Some(op.remote) =>
                {
                    last.len += op.len;
                }
                pending => {
                    if let Some((_, done)) = pending.replace((array, op)) {
                        return Some(done);
                    }
                }
            }
        }
    }
}

/// Hands `ops` to `send` at most [`BATCH`] at a time, each with what is left until `deadline`
/// (and whether it is the first batch); the bytes of all. A transfer with no ops sends one
/// empty batch; one whose deadline passes between batches fails as timed out.
pub fn in_batches(
    ops: impl Iterator<Item = PutOp>,
    deadline: Instant,
    mut send: impl FnMut(Vec<PutOp>, Duration, bool) -> Result<u64, OpError>,
) -> Result<u64, OpError> {
    let mut ops = ops.peekable();
    let mut bytes = 0u64;
    let mut first = true;
    loop {
        let batch: Vec<PutOp> = ops.by_ref().take(BATCH).collect();
        let left = deadline.saturating_duration_since(Instant::now());
        if !first && left.is_zero() {
            // Nothing is in flight: the caller closes the link on a timeout, as after one inside a
            // batch.
            return Err(OpError::Timeout(format!(
                "it passed between batches of ops, {bytes} bytes moved"
            )));
        }
        bytes += send(batch, left, first)?;
        first = false;
        if ops.peek().is_none() {
            return Ok(bytes);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn place(local: u64, remote: u64, stride: u64) -> Place {
        Place {
            local,
            local_stride: stride,
            remote,
            remote_stride: stride,
            set: 0,
        }
    }

    fn items(pairs: &[(u32, u32)]) -> Vec<Item> {
        pairs
            .iter()
            .map(|(l, r)| Item {
                local: *l,
                at: 0,
                remote: *r,
            })
            .collect()
    }

    fn whole(len: u64) -> Vec<Piece> {
        vec![Piece {
            local: 0,
            remote: 0,
            len,
        }]
    }

    #[test]
    fn consecutive_blocks_on_both_sides_are_one_op_per_array_and_a_gap_starts_another() {
        let plan = Plan {
            arrays: vec![place(0x1000, 0x9000, 64), place(0x1000 + 64 * 8, 0x9000 + 64 * 8, 64)],
            items: items(&[(0, 2), (1, 3), (2, 4), (5, 5), (6, 7)]),
            sets: vec![Pieces {
                part_len: 0,
                pieces: whole(64),
            }],
            block_major: false,
        };
        let ops: Vec<PutOp> = plan.ops().collect();
        let op = |local, remote, len| PutOp { local, len, remote };
        assert_eq!(
            ops,
            vec![
                op(0x1000, 0x9000 + 128, 192),
                op(0x1000 + 5 * 64, 0x9000 + 5 * 64, 64),
                op(0x1000 + 6 * 64, 0x9000 + 7 * 64, 64),
                op(0x1200, 0x9200 + 128, 192),
                op(0x1200 + 5 * 64, 0x9200 + 5 * 64, 64),
                op(0x1200 + 6 * 64, 0x9200 + 7 * 64, 64),
            ]
        );
        // Two arrays that touch on both sides stay two ops.
        let touching = Plan {
            arrays: vec![place(0x1000, 0x9000, 64), place(0x1040, 0x9040, 64)],
            items: items(&[(0, 0)]),
            sets: vec![Pieces {
                part_len: 0,
                pieces: whole(64),
            }],
            block_major: false,
        };
        assert_eq!(
            touching.ops().collect::<Vec<_>>(),
            vec![op(0x1000, 0x9000, 64), op(0x1040, 0x9040, 64)]
        );
    }

    #[test]
    fn blocks_with_gaps_between_them_are_an_op_each_and_pieces_land_at_their_offsets() {
        // Blocks 128 bytes apart (K and V interleaved), of which 2 heads of 16 bytes move from
        // heads 1.. of ours into heads 0.. of the peer's; our blocks gather two parts.
        let plan = Plan {
            arrays: vec![place(0, 1 << 20, 128)],
            items: vec![
                Item {
                    local: 0,
                    at: 0,
                    remote: 0,
                },
                Item {
                    local: 0,
                    at: 1,
                    remote: 1,
                },
            ],
            sets: vec![Pieces {
                part_len: 8,
                pieces: vec![
                    Piece {
                        local: 16,
                        remote: 0,
                        len: 8,
                    },
                    Piece {
                        local: 32,
                        remote: 8,
                        len: 8,
                    },
                ],
            }],
            block_major: false,
        };
        let got: Vec<(u64, u64, u64)> = plan.ops().map(|o| (o.local, o.remote, o.len)).collect();
        let r = 1 << 20;
        assert_eq!(
            got,
            vec![
                (16, r, 8),
                (32, r + 8, 8),
                // Part 1 of our block 0, from the peer's block 1: its first piece starts
                // where part 0's first piece ended on our side, not on the peer's.
                (24, r + 128, 8),
                (40, r + 136, 8)
            ]
        );
    }

    #[test]
    fn block_by_block_a_blocks_arrays_back_to_back_are_one_op() {
        // Blocks outermost: 3 arrays (layers) 64 bytes apart, blocks 192 bytes apart, both sides.
        let arrays: Vec<Place> = (0..3u64)
            .map(|a| place(0x1000 + 64 * a, 0x9000 + 64 * a, 192))
            .collect();
        let plan = |block_major| Plan {
            arrays: arrays.clone(),
            items: items(&[(0, 1), (1, 2), (4, 3)]),
            sets: vec![Pieces {
                part_len: 0,
                pieces: whole(64),
            }],
            block_major,
        };
        let op = |local, remote, len| PutOp { local, len, remote };
        // Block by block: blocks 0 and 1 (1 and 2 at the peer) are one run of all three layers.
        assert_eq!(
            plan(true).ops().collect::<Vec<_>>(),
            vec![
                op(0x1000, 0x9000 + 192, 384),
                op(0x1000 + 4 * 192, 0x9000 + 3 * 192, 192)
            ]
        );
        // Array by array: an op per block and layer (a layer's blocks are 192 bytes apart).
        let by_array: Vec<PutOp> = plan(false).ops().collect();
        assert_eq!(by_array.len(), 9);
        let bytes = |ops: &[PutOp]| {
            let mut b: Vec<(u64, u64)> = ops
                .iter()
                .flat_map(|o| (0..o.len / 64).map(move |i| (o.local + 64 * i, o.remote + 64 * i)))
                .collect();
            b.sort_unstable();
            b
        };
        assert_eq!(
            bytes(&plan(true).ops().collect::<Vec<_>>()),
            bytes(&by_array),
            "the same bytes move"
        );
    }

    #[test]
    fn arrays_with_nothing_to_move_are_skipped_in_either_order() {
        // Arrays 1 (an empty set) and 2 (naming no set) move nothing; 0 and 3 two pieces a
        // block. Nothing is adjacent, so every piece is an op.
        let mut arrays: Vec<Place> = (0..4u64)
            .map(|a| place(0x10000 * (a + 1), 0x90000 * (a + 1), 0x1000))
            .collect();
        arrays[1].set = 1;
        arrays[2].set = 7;
        let two = vec![
            Piece {
                local: 0,
                remote: 0,
                len: 16,
            },
            Piece {
                local: 64,
                remote: 32,
                len: 16,
            },
        ];
        for block_major in [false, true] {
            let plan = Plan {
                arrays: arrays.clone(),
                items: items(&[(0, 2), (3, 1), (5, 0)]),
                sets: vec![
                    Pieces {
                        part_len: 0,
                        pieces: two.clone(),
                    },
                    Pieces {
                        part_len: 0,
                        pieces: Vec::new(),
                    },
                ],
                block_major,
            };
            // The walk written out: arrays outermost, or items.
            let mut want = Vec::new();
            let (outer, inner) = if block_major { (3, 4) } else { (4, 3) };
            for o in 0..outer {
                for i in 0..inner {
                    let (array, item) = if block_major { (i, o) } else { (o, i) };
                    if array == 0 || array == 3 {
                        want.extend((0..2).map(|p| plan.op(array, item, p)));
                    }
                }
            }
            assert_eq!(want.len(), 12);
            assert_eq!(plan.ops().collect::<Vec<_>>(), want, "block major: {block_major}");
        }
    }

    #[test]
    fn pieces_follow_each_sides_layout_and_merge_where_they_agree() {
        let shape = |tokens, heads, nhd, unit| BlockShape {
            tokens,
            heads,
            nhd,
            unit,
        };
        let piece = |local, remote, len| Piece { local, remote, len };
        // Laid out alike (HND, 8-byte halves): one piece of the block.
        let dense = shape(4, 2, false, 8);
        assert_eq!(pieces(&dense, 0, &dense, 0, 2, 4, 8), Ok(vec![piece(0, 0, 64)]));
        // A head range of ours into another range of theirs (HND): one piece per range.
        let wide = shape(4, 4, false, 8);
        assert_eq!(pieces(&wide, 1, &dense, 0, 2, 4, 8), Ok(vec![piece(32, 0, 64)]));
        // NHD, a head range: a piece per token.
        let (wide_n, dense_n) = (shape(4, 4, true, 8), shape(4, 2, true, 8));
        assert_eq!(
            pieces(&wide_n, 2, &dense_n, 0, 2, 2, 8),
            Ok(vec![piece(16, 0, 16), piece(48, 16, 16)])
        );
        // K and V side by side here (16 bytes apart), apart there: a piece per head's token, in
        // our order, each landing at its dense place.
        let sbs = shape(4, 2, false, 16);
        let got = pieces(&sbs, 0, &dense, 0, 2, 4, 8).expect("pieces");
        assert_eq!(got.len(), 8);
        assert_eq!(got[5], piece(5 * 16, 5 * 8, 8), "head 1, token 1");
        // Both side by side, K and V together: one piece.
        assert_eq!(pieces(&sbs, 0, &sbs, 0, 2, 4, 16), Ok(vec![piece(0, 0, 128)]));
        // The first two tokens of a block gathering smaller ones (decode's 4, prefill's 2).
        let small = shape(2, 2, false, 8);
        assert_eq!(
            pieces(&dense, 0, &small, 0, 2, 2, 8),
            Ok(vec![piece(0, 0, 16), piece(32, 16, 16)])
        );
        // Outside either block, or past the bound: refused.
        assert!(pieces(&dense, 1, &dense, 0, 2, 4, 8).is_err());
        assert!(pieces(&dense, 0, &small, 0, 2, 4, 8).is_err());
        let huge = shape(1 << 20, 1, false, 16);
        let e = pieces(&huge, 0, &shape(1 << 20, 1, false, 8), 0, 1, 1 << 20, 8).expect_err("too many");
        assert!(e.contains(&format!("more than {MAX_PIECES} pieces")), "{e}");
    }

    #[test]
    fn a_plan_of_millions_of_ops_makes_each_in_turn_from_its_arrays_and_blocks() {
        // 1024 layers × 2 arrays × 8192 scattered blocks: 16.8M ops, none held.
        let plan = Plan {
            arrays: (0..2048u64).map(|a| place(a << 32, a << 32, 16)).collect(),
            items: items(&(0..8192u32).map(|b| (2 * b, 2 * b)).collect::<Vec<_>>()),
            sets: vec![Pieces {
                part_len: 0,
                pieces: whole(8),
            }],
            block_major: false,
        };
        let mut ops = plan.ops();
        let first: Vec<PutOp> = ops.by_ref().take(3).collect();
        assert_eq!(first[2].local, 64);
        assert_eq!(ops.count(), 2048 * 8192 - 3);
    }

    #[test]
    fn batches_are_bounded_and_carry_every_op_in_order() {
        let plan = Plan {
            arrays: vec![place(0, 0, 16)],
            items: items(&(0..(2 * BATCH as u32 + 5)).map(|b| (2 * b, 2 * b)).collect::<Vec<_>>()),
            sets: vec![Pieces {
                part_len: 0,
                pieces: whole(8),
            }],
            block_major: false,
        };
        let mut seen = Vec::new();
        let mut sizes = Vec::new();
        let bytes = in_batches(
            plan.ops(),
            Instant::now() + Duration::from_secs(60),
            |batch, left, first| {
                assert_eq!(first, sizes.is_empty());
                assert!(left > Duration::from_secs(50));
                sizes.push(batch.len());
                seen.extend(batch.iter().map(|o| o.local));
                Ok(batch.iter().map(|o| o.len).sum())
            },
        )
        .expect("sent");
        assert_eq!(sizes, vec![BATCH, BATCH, 5]);
        assert_eq!(bytes, 8 * (2 * BATCH as u64 + 5));
        assert!(seen.iter().zip(seen.iter().skip(1)).all(|(a, b)| b - a == 32));
    }

    #[test]
    fn a_failed_batch_ends_the_transfer_and_an_empty_one_is_still_sent_once() {
        let plan = Plan {
            arrays: vec![place(0, 0, 16)],
            items: items(&(0..(BATCH as u32 + 1)).map(|b| (2 * b, 2 * b)).collect::<Vec<_>>()),
            sets: vec![Pieces {
                part_len: 0,
                pieces: whole(8),
            }],
            block_major: false,
        };
        let mut calls = 0;
        let failed = in_batches(plan.ops(), Instant::now() + Duration::from_secs(60), |_, _, _| {
            calls += 1;
            Err(OpError::Failed("no".into()))
        });
        assert_eq!((failed, calls), (Err(OpError::Failed("no".into())), 1));
        let mut empties = 0;
        let none = in_batches(Plan::default().ops(), Instant::now(), |batch, _, first| {
            assert!(batch.is_empty() && first);
            empties += 1;
            Ok(0)
        });
        assert_eq!((none, empties), (Ok(0), 1));
        // A deadline passed after the first batch: the second is not sent.
        let mut sent = 0;
        let late = in_batches(plan.ops(), Instant::now(), |_, _, _| {
            sent += 1;
            Ok(1)
        });
        assert!(matches!(late, Err(OpError::Timeout(_))), "{late:?}");
        assert_eq!(sent, 1);
    }
}
