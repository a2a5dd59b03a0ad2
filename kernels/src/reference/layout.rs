//! Routing metadata of the contract (§6): which token goes to which rank, counts, and the
//! channel bookkeeping of the intranode handle.

/// Output of the layout step for one rank's `topk_idx`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    pub num_tokens: usize,
    pub num_ranks: usize,
    pub num_experts: usize,
    /// `[R]`: tokens sent to each rank (a token counts once per rank).
    pub num_tokens_per_rank: Vec<i32>,
    /// `[E]`: number of `(t, k)` selections of each expert.
    pub num_tokens_per_expert: Vec<i32>,
    /// `[N, R]` row-major.
    pub is_token_in_rank: Vec<bool>,
}

/// Compute [`Layout`] for `topk_idx` `[n, k]` (`-1` = unused). Errors on bad shapes, ids out of
/// `[-1, E)`, or `E % R != 0`.
pub fn layout(topk_idx: &[i64], n: usize, k: usize, num_experts: usize, num_ranks: usize) -> crate::Result<Layout> {
    crate::validate::experts(num_experts, num_ranks)?;
    crate::validate::topk_idx(topk_idx, n, k, num_experts)?;
    let l = (num_experts / num_ranks) as i64;
    let mut per_rank = vec![0i32; num_ranks];
    let mut per_expert = vec![0i32; num_experts];
    let mut in_rank = vec![false; n * num_ranks];
    for t in 0..n {
        for &e in &topk_idx[t * k..(t + 1) * k] {
            if e < 0 {
                continue;
            }
            per_expert[e as usize] += 1;
            let r = (e / l) as usize;
            if !in_rank[t * num_ranks + r] {
                in_rank[t * num_ranks + r] = true;
                per_rank[r] += 1;
            }
        }
    }
    Ok(Layout {
        num_tokens: n,
        num_ranks,
        num_experts,
        num_tokens_per_rank: per_rank,
        num_tokens_per_expert: per_expert,
        is_token_in_rank: in_rank,
    })
}

/// Token range `[begin, end)` owned by channel `c` of `num_channels`:
/// `[min(c·⌈N/C⌉, N), min((c+1)·⌈N/C⌉, N))`.
pub fn channel_range(n: usize, num_channels: usize, c: usize) -> (usize, usize) {
    assert!(num_channels > 0, "channel_range: num_channels must be positive (num_sms / 2)");
    let per = n.div_ceil(num_channels);
    ((c * per).min(n), ((c + 1) * per).min(n))
}

impl Layout {
    #[inline]
    pub fn in_rank(&self, t: usize, r: usize) -> bool {
        self.is_token_in_rank[t * self.num_ranks + r]
    }

    /// `[R / ranks_per_node]`: tokens sent to any rank of each node (a token counts once per node).
    pub fn num_tokens_per_node(&self, ranks_per_node: usize) -> Vec<i32> {
        assert!(ranks_per_node > 0 && self.num_ranks % ranks_per_node == 0, "ranks_per_node must divide the rank count");
        let nodes = self.num_ranks / ranks_per_node;
        let mut out = vec![0i32; nodes];
        for t in 0..self.num_tokens {
            for (node, count) in out.iter_mut().enumerate() {
                if (node * ranks_per_node..(node + 1) * ranks_per_node).any(|r| self.in_rank(t, r)) {
                    *count += 1;
                }
            }
        }
        out
    }

    /// Sender-side `channel_prefix_matrix` `[R, C]` row-major: entry `[d][c]` = number of tokens
    /// at positions `< end(c)` that go to rank `d` (inclusive prefix over channels).
    pub fn channel_prefix_matrix(&self, num_channels: usize) -> Vec<i32> {
        let r = self.num_ranks;
        let mut out = vec![0i32; r * num_channels];
        for d in 0..r {
            let mut acc = 0;
            for c in 0..num_channels {
                let (b, e) = channel_range(self.num_tokens, num_channels, c);
                acc += (b..e).filter(|&t| self.in_rank(t, d)).count() as i32;
                out[d * num_channels + c] = acc;
            }
        }
        out
    }

    /// `send_head` `[N, R]` row-major: for a token `t` of channel `c` that goes to rank `d`, the
    /// number of earlier tokens of channel `c` that go to `d` (its slot in the `(c, d)` stream);
    /// `-1` when `t` does not go to `d` (before combine-prep rewriting).
    pub fn send_head(&self, num_channels: usize) -> Vec<i32> {
        let r = self.num_ranks;
        let mut out = vec![-1i32; self.num_tokens * r];
        for c in 0..num_channels {
            let (b, e) = channel_range(self.num_tokens, num_channels, c);
            for d in 0..r {
                let mut slot = 0;
                for t in b..e {
                    if self.in_rank(t, d) {
                        out[t * r + d] = slot;
                        slot += 1;
                    }
                }
            }
        }
        out
    }
}

/// Receiver-side `recv_channel_prefix_matrix` `[R, C]` of destination `d`, given every source
/// rank's layout: entry `[s][c]` = exclusive offset of source `s`'s channel `c` inside `s`'s block.
pub fn recv_channel_prefix_matrix(layouts: &[Layout], d: usize, num_channels: usize) -> Vec<i32> {
    let mut out = vec![0i32; layouts.len() * num_channels];
    for (s, lay) in layouts.iter().enumerate() {
        let cpm = lay.channel_prefix_matrix(num_channels);
        for c in 1..num_channels {
            out[s * num_channels + c] = cpm[d * num_channels + c - 1];
        }
    }
    out
}

/// `rank_prefix_matrix` column of destination `d`: entry `s` = tokens sent to `d` by sources
/// `0..=s` (inclusive prefix).
pub fn rank_prefix(layouts: &[Layout], d: usize) -> Vec<i32> {
    let mut acc = 0;
    layouts
        .iter()
        .map(|l| {
            acc += l.num_tokens_per_rank[d];
            acc
        })
        .collect()
}

/// Full `rank_prefix_matrix` `[R, R]` row-major as every rank sees it after notify:
/// `[i][j]` = tokens sent to rank `j` by sources `0..=i`.
pub fn rank_prefix_matrix(layouts: &[Layout]) -> Vec<i32> {
    let r = layouts.len();
    let mut out = vec![0i32; r * r];
    for j in 0..r {
        for (i, v) in rank_prefix(layouts, j).into_iter().enumerate() {
            out[i * r + j] = v;
        }
    }
    out
}
