//! Which transports and devices UCX chose for one endpoint, read from `ucp_ep_print_info` (UCX
//! 1.13 has no `ucp_ep_query` field for them; 1.14 added one), and the class of path they make.
//!
//! The text is UCX's, not a peer's, but it is parsed defensively all the same: lines that do not
//! parse are skipped, and at most [`MAX_LANES`] lanes are kept.

use pdpair_api::PathKind;

/// The most lanes kept for one endpoint (UCX 1.13 allows 8 per endpoint).
pub const MAX_LANES: usize = 16;

/// One UCX lane: a transport on a device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lane {
    /// Its index in the endpoint's configuration.
    pub index: u32,
    /// The transport (`tcp`, `posix`, `rc_mlx5`, ...).
    pub transport: String,
    /// The device (`lo`, `memory`, `mlx5_0:1`, ...).
    pub device: String,
    /// What UCX uses it for (`am`, `am_bw#0`, `rma_bw#0`, `wireup`, ...).
    pub usage: Vec<String>,
}

impl Lane {
    /// `transport/device`.
    pub fn name(&self) -> String {
        format!("{}/{}", self.transport, self.device)
    }
}

/// An endpoint's lanes and which of them carry remote memory access.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Lanes {
    /// Every lane.
    pub all: Vec<Lane>,
    /// Indices of the lanes that carry puts and gets (`put[i]`/`get[i]` lines, or `rma` usage).
    pub rma: Vec<u32>,
}

impl Lanes {
    /// Parses `ucp_ep_print_info` output.
    pub fn parse(text: &str) -> Lanes {
        let mut out = Lanes::default();
        for line in text.lines() {
            let line = line.trim_start_matches('#').trim();
            if let Some(lane) = parse_lane(line) {
                if out.all.len() < MAX_LANES {
                    out.all.push(lane);
                }
            } else if let Some(i) = parse_rma_line(line)
                && !out.rma.contains(&i)
            {
                out.rma.push(i);
            }
        }
        for lane in &out.all {
            if lane.usage.iter().any(|u| u.starts_with("rma")) && !out.rma.contains(&lane.index) {
                out.rma.push(lane.index);
            }
        }
        out.rma.retain(|i| out.all.iter().any(|l| l.index == *i));
        out.rma.sort_unstable();
        out
    }

    /// The lanes puts and gets travel on: for an endpoint to this very worker (it has a `self`
    /// lane), its self lanes; else the RMA lanes; else the lanes UCX lists for no use it names
    /// (UCX 1.22 prints no RMA use, nor `put[i]` lines, for shared memory's lanes; 1.13 gave
    /// such a lane `put[i]` lines); or, when UCX has none of these for this peer (it then
    /// emulates RMA with active messages), the lanes that carry messages.
    pub fn carrying(&self) -> (Vec<&Lane>, bool) {
        let own: Vec<&Lane> = self.all.iter().filter(|l| l.transport == "self").collect();
        if !own.is_empty() {
            return (own, false);
        }
        let rma: Vec<&Lane> = self.all.iter().filter(|l| self.rma.contains(&l.index)).collect();
        if !rma.is_empty() {
            return (rma, false);
        }
        let unnamed: Vec<&Lane> = self.all.iter().filter(|l| l.usage.is_empty()).collect();
        if !unnamed.is_empty() {
            return (unnamed, false);
        }
        let am: Vec<&Lane> = self
            .all
            .iter()
            .filter(|l| l.usage.iter().any(|u| u.starts_with("am")))
            .collect();
        (if am.is_empty() { self.all.iter().collect() } else { am }, true)
    }

    /// The class of path: `Local` when the endpoint has a `self` lane (only an endpoint to this
    /// very worker has one: both engines are behind this agent; UCX 1.22 lists RMA on tcp lanes
    /// beside it), else the worst of
    /// the carrying lanes (TCP beside RDMA is TCP; the first such lane names it), `Other` when
    /// there are none.
    pub fn kind(&self) -> PathKind {
        let (lanes, _) = self.carrying();
        let kinds: Vec<PathKind> = lanes.iter().map(|l| classify(&l.transport)).collect();
        if kinds.contains(&PathKind::Local) {
            return PathKind::Local;
        }
        let mut worst: Option<PathKind> = None;
        for k in kinds {
            if worst.is_none_or(|w| k.rank() > w.rank()) {
                worst = Some(k);
            }
        }
        worst.unwrap_or(PathKind::Other)
    }

    /// The carrying lanes' names, deduplicated, in lane order.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = Vec::new();
        for lane in self.carrying().0 {
            let name = lane.name();
            if !names.contains(&name) {
                names.push(name);
            }
        }
        names
    }
}

/// The class of a UCX transport.
pub fn classify(transport: &str) -> PathKind {
    match transport {
        "self" => PathKind::Local,
        "tcp" => PathKind::Tcp,
        "posix" | "sysv" | "cma" | "xpmem" | "knem" => PathKind::SharedMemory,
        t if ["rc", "dc", "ud"].iter().any(|p| t.starts_with(p)) => PathKind::Rdma,
        _ => PathKind::Other,
    }
}

/// `lane[0]:  3:sysv/memory.0 md[2]  -> md[2]/sysv/sysdev[255] am am_bw#0`.
fn parse_lane(line: &str) -> Option<Lane> {
    let rest = line.strip_prefix("lane[")?;
    let (index, rest) = rest.split_once("]:")?;
    let index: u32 = index.parse().ok()?;
    let mut words = rest.split_whitespace();
    // `3:sysv/memory.0`: resource index, transport, device and path index.
    let resource = words.next()?;
    let (_, tl_dev) = resource.split_once(':')?;
    let (transport, device) = tl_dev.split_once('/')?;
    let device = match device.rsplit_once('.') {
        Some((d, path)) if path.chars().all(|c| c.is_ascii_digit()) => d,
        _ => device,
    };
    if transport.is_empty() || device.is_empty() {
        return None;
    }
    // After the `->` and the remote md come the usage words (UCX 1.16+ puts the segment size,
    // `seg 8256`, first: not a use).
    let usage = rest
        .split_once("->")
        .map(|(_, r)| {
            let mut words = r.split_whitespace().skip(1).peekable();
            if words.peek() == Some(&"seg") {
                words.next();
                words.next();
            }
            words.map(str::to_owned).collect()
        })
        .unwrap_or_default();
    Some(Lane {
        index,
        transport: transport.to_owned(),
        device: device.to_owned(),
        usage,
    })
}

/// `put[1]: 0..<short>..` or `get[0]: ...`: lane 1 or 0 carries RMA.
fn parse_rma_line(line: &str) -> Option<u32> {
    let rest = line.strip_prefix("put[").or_else(|| line.strip_prefix("get["))?;
    let (index, _) = rest.split_once("]:")?;
    index.parse().ok()
}

#[cfg(test)]
mod tests;
