//! Parsing `ucp_ep_print_info` as UCX 1.13 and 1.22 print it here (the shm, tcp and self texts
//! were captured from this machine's UCX), and as newer versions print RDMA lanes.

use super::*;

const SHM: &str = "#
# UCP endpoint
#
#               peer: <no debug data>
#                 lane[0]:  3:sysv/memory.0 md[2]           -> md[2]/sysv/sysdev[255] am am_bw#0
#                 lane[1]:  4:posix/memory.0 md[3]          -> md[3]/posix/sysdev[255]
#
#                  put[0]: 0..<short>..4294967296..<bcopy>..(inf)
#                  get[0]: 0..<bcopy>..(inf)
#                  put[1]: 0..<short>..4294967296..<bcopy>..(inf)
#                  get[1]: 0..<bcopy>..(inf)
#
#                  rma_bw: mds #
";

const TCP: &str = "#
# UCP endpoint
#
#               peer: <no debug data>
#                 lane[0]:  2:tcp/lo.0 md[1]                -> md[1]/tcp/sysdev[255] am am_bw#0 wireup
#
#
#                  rma_bw: mds #
";

// As UCX 1.16+ prints lanes (remote address index, segment size), on a host with two RDMA ports
// and a TCP interface.
const RDMA: &str = "
lane[0]:  0:rc_mlx5/mlx5_0:1.0 md[0]      -> addr[0].md[0]/ib/sysdev[1] seg 8256 am am_bw#0
lane[1]:  4:rc_mlx5/mlx5_2:1.0 md[2]      -> addr[4].md[2]/ib/sysdev[3] seg 8256 rma_bw#0
lane[2]:  2:rc_mlx5/mlx5_1:1.0 md[1]      -> addr[2].md[1]/ib/sysdev[2] seg 8256 rma_bw#1 wireup
";

#[test]
fn shared_memory_lanes_carry_the_puts() {
    let lanes = Lanes::parse(SHM);
    assert_eq!(lanes.all.len(), 2);
    assert_eq!(lanes.all[0].usage, ["am", "am_bw#0"]);
    assert_eq!(lanes.rma, [0, 1]);
    assert_eq!(lanes.names(), ["sysv/memory", "posix/memory"]);
    assert!(!lanes.carrying().1, "native RMA");
    assert_eq!(lanes.kind(), PathKind::SharedMemory);
}

#[test]
fn tcp_has_no_rma_lane_so_puts_are_emulated_over_its_message_lane() {
    let lanes = Lanes::parse(TCP);
    assert!(lanes.rma.is_empty());
    let (carrying, emulated) = lanes.carrying();
    assert!(emulated);
    assert_eq!(carrying.len(), 1);
    assert_eq!(lanes.names(), ["tcp/lo"]);
    assert_eq!(lanes.kind(), PathKind::Tcp);
}

#[test]
fn rdma_bandwidth_lanes_are_the_carrying_ones_and_make_an_rdma_path() {
    let lanes = Lanes::parse(RDMA);
    assert_eq!(lanes.rma, [1, 2], "from the rma_bw usage");
    assert_eq!(lanes.all[0].usage, ["am", "am_bw#0"], "the segment size is not a use");
    assert_eq!(lanes.names(), ["rc_mlx5/mlx5_2:1", "rc_mlx5/mlx5_1:1"]);
    assert_eq!(lanes.kind(), PathKind::Rdma);
}

#[test]
fn tcp_beside_rdma_makes_the_path_tcp() {
    let text = format!("{RDMA}lane[3]:  5:tcp/eth0.0 md[3] -> addr[5].md[3]/tcp/sysdev[255] rma_bw#2\n");
    let lanes = Lanes::parse(&text);
    assert_eq!(lanes.kind(), PathKind::Tcp, "the worst carrying lane decides");
}

// An endpoint to the agent's own worker (both engines behind one agent), captured here.
const SELF: &str = "#
#                 lane[0]:  0:self/memory0.0 md[0]          -> md[0]/self/sysdev[255] am am_bw#0
#                 lane[1]:  3:sysv/memory.0 md[2]           -> md[2]/sysv/sysdev[255]
#                 lane[2]:  4:posix/memory.0 md[3]          -> md[3]/posix/sysdev[255]
#
#                  put[0]: 0..<short>..4294967296..<bcopy>..(inf)
#                  put[1]: 0..<short>..4294967296..<bcopy>..(inf)
#                  put[2]: 0..<short>..4294967296..<bcopy>..(inf)
";

#[test]
fn an_endpoint_to_the_agents_own_worker_is_local() {
    let lanes = Lanes::parse(SELF);
    assert_eq!(lanes.kind(), PathKind::Local);
    assert_eq!(lanes.names(), ["self/memory0"], "the self lane carries it");
}

// UCX 1.22 (the libucx-cu12 wheel), captured here: tcp carries RMA itself (no emulation), on
// the loopback and the host's other interface; an endpoint to its own worker lists RMA on tcp
// beside its self lane.
const TCP_122: &str = "#
#                 lane[0]:  2:tcp/lo.0 md[1]                -> md[1]/tcp/sysdev[255] seg 4294967295 rma_bw#0 am
#                 lane[1]:  1:tcp/eth0.0 md[1]              -> md[1]/tcp/sysdev[255] seg 4294967295 rma_bw#1 wireup
";
const SELF_122: &str = "#
#                 lane[0]:  0:self/memory.0 md[0]           -> md[0]/self/sysdev[255] seg 4294967295 am rkey_ptr
#                 lane[1]:  2:tcp/lo.0 md[1]                -> md[1]/tcp/sysdev[255] seg 4294967295 rma_bw#0
#                 lane[2]:  1:tcp/eth0.0 md[1]              -> md[1]/tcp/sysdev[255] seg 4294967295 rma_bw#1 wireup
";

const SHM_122: &str = "#
#                 lane[0]:  1:sysv/memory.0 md[1]           -> md[1]/sysv/sysdev[255] seg 4294967295 am
#                 lane[1]:  2:posix/memory.0 md[2]          -> md[2]/posix/sysdev[255] seg 4294967295
";

#[test]
fn ucx_1_22_shared_memory_lists_its_rma_lane_for_no_named_use() {
    let lanes = Lanes::parse(SHM_122);
    assert!(lanes.rma.is_empty());
    assert_eq!(lanes.carrying(), (vec![&lanes.all[1]], false));
    assert_eq!(lanes.names(), ["posix/memory"]);
    assert_eq!(lanes.kind(), PathKind::SharedMemory);
}

#[test]
fn ucx_1_22_tcp_puts_natively_and_a_self_lane_is_still_local() {
    let lanes = Lanes::parse(TCP_122);
    assert_eq!(lanes.rma, [0, 1]);
    assert!(!lanes.carrying().1, "tcp's own RMA");
    assert_eq!(lanes.names(), ["tcp/lo", "tcp/eth0"]);
    assert_eq!(lanes.kind(), PathKind::Tcp);
    let own = Lanes::parse(SELF_122);
    assert_eq!(own.names(), ["self/memory"], "not the tcp lanes listed beside it");
    assert_eq!(own.kind(), PathKind::Local, "the self lane decides");
}

#[test]
fn transports_are_classified() {
    for (tl, kind) in [
        ("rc_verbs", PathKind::Rdma),
        ("dc_mlx5", PathKind::Rdma),
        ("ud_mlx5", PathKind::Rdma),
        ("posix", PathKind::SharedMemory),
        ("cma", PathKind::SharedMemory),
        ("xpmem", PathKind::SharedMemory),
        ("self", PathKind::Local),
        ("tcp", PathKind::Tcp),
        ("cuda_ipc", PathKind::Other),
        ("", PathKind::Other),
    ] {
        assert_eq!(classify(tl), kind, "{tl}");
    }
}

#[test]
fn garbage_and_overlong_text_parse_to_bounded_lanes() {
    assert_eq!(Lanes::parse(""), Lanes::default());
    assert_eq!(Lanes::parse("lane[x]: 1:tcp/lo.0\nlane[1]: nocolon\nput[9]: x").all, []);
    let many: String = (0..100)
        .map(|i| format!("lane[{i}]:  {i}:tcp/lo.0 md[1] -> md[1]/tcp am\nput[{i}]: x\n"))
        .collect();
    let lanes = Lanes::parse(&many);
    assert_eq!(lanes.all.len(), MAX_LANES);
    assert!(
        lanes.rma.iter().all(|i| (*i as usize) < MAX_LANES),
        "put lines of dropped lanes dropped too"
    );
    assert_eq!(
        Lanes::parse("").kind(),
        PathKind::Other,
        "no lanes: unclassified, not a good path"
    );
}
