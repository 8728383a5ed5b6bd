use std::net::Ipv4Addr;

use super::*;

const LOOPBACK: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);
const SECOND: Duration = Duration::from_secs(1);

/// `len` bytes of memory filled with `fill`, registered with `s` as region `id`.
fn region(s: &Stream, id: u64, len: usize, fill: u8) -> (u64, Arc<memmap2::MmapRaw>) {
    let mut m = memmap2::MmapOptions::new()
        .len(len)
        .map_anon()
        .expect("anonymous memory");
    m.fill(fill);
    let raw: Arc<memmap2::MmapRaw> = Arc::new(m.into());
    let base = raw.as_mut_ptr() as u64;
    s.register(id, base, len as u64, raw.clone());
    (base, raw)
}

fn bytes(m: &memmap2::MmapRaw) -> Vec<u8> {
    // SAFETY: the mapping is alive and nothing writes it while the test reads.
    unsafe { std::slice::from_raw_parts(m.as_ptr(), m.len()) }.to_vec()
}

fn key(b: u8) -> [u8; 32] {
    [b; 32]
}

/// Decode (`d`, admitting writes into region 1 with `key(1)`) and prefill (`p`, dialled in with
/// region 7 as its source).
struct Pair {
    d: Stream,
    p: Stream,
    d_mem: (u64, Arc<memmap2::MmapRaw>),
    p_mem: (u64, Arc<memmap2::MmapRaw>),
    admission: Option<Admission>,
}

fn pair(access: Access) -> Pair {
    let d = Stream::start(LOOPBACK).expect("decode's stream");
    let p = Stream::start(LOOPBACK).expect("prefill's stream");
    let d_mem = region(&d, 1, 4096, 0);
    let p_mem = region(&p, 7, 4096, 0xab);
    let admission = d.admit(&key(1), &[1], access).expect("admitted");
    // A request of the link's over all of the region (the windows' own tests narrow them).
    admission.windows.allow("all", vec![(d_mem.0, 4096)]);
    Pair {
        d,
        p,
        d_mem,
        p_mem,
        admission: Some(admission),
    }
}

fn op(local: u64, remote: u64, len: u64) -> PutOp {
    PutOp { local, len, remote }
}

#[test]
fn an_admitted_peer_writes_and_reads_inside_the_admitted_regions() {
    let t = pair(Access::Write);
    let peer =
        t.p.connect(&t.d.address(), vec![(t.d_mem.0, 4096)], &key(1))
            .expect("connected");
    let n =
        t.p.put(
            peer,
            &[7],
            &[op(t.p_mem.0, t.d_mem.0 + 100, 200), op(t.p_mem.0, t.d_mem.0 + 1000, 50)],
            false,
            SECOND,
        )
        .expect("written");
    assert_eq!(n, 250);
    let got = bytes(&t.d_mem.1);
    assert!(got[100..300].iter().all(|b| *b == 0xab) && got[1000..1050].iter().all(|b| *b == 0xab));
    assert!(
        got[..100].iter().all(|b| *b == 0)
            && got[300..1000].iter().all(|b| *b == 0)
            && got[1050..].iter().all(|b| *b == 0)
    );
    let seen = t.p.observe(peer).expect("observed");
    assert_eq!(seen.kind, pdpair_api::PathKind::Tcp);
    assert_eq!(seen.backend, pdpair_api::Backend::TcpStream);

    // Pull: decode dials prefill, which admitted reads.
    let admission = t.p.admit(&key(2), &[7], Access::Read).expect("admitted");
    admission.windows.allow("lent", vec![(t.p_mem.0, 4096)]);
    let peer =
        t.d.connect(&t.p.address(), vec![(t.p_mem.0, 4096)], &key(2))
            .expect("connected");
    let many: Vec<PutOp> = (0..600).map(|i| op(t.d_mem.0 + 2048 + i, t.p_mem.0 + i, 1)).collect();
    assert_eq!(t.d.get(peer, &[1], &many, SECOND).expect("read"), 600);
    assert!(bytes(&t.d_mem.1)[2048..2648].iter().all(|b| *b == 0xab));
    drop(admission);
}

#[test]
fn corrupt_flips_a_byte_in_flight() {
    let t = pair(Access::Write);
    let peer =
        t.p.connect(&t.d.address(), vec![(t.d_mem.0, 4096)], &key(1))
            .expect("connected");
    t.p.put(peer, &[7], &[op(t.p_mem.0, t.d_mem.0, 64)], true, SECOND)
        .expect("written");
    let got = bytes(&t.d_mem.1);
    assert_eq!(got[..64].iter().filter(|b| **b != 0xab).count(), 1);
}

#[test]
fn a_dialler_without_the_key_is_refused_and_writes_nothing() {
    let t = pair(Access::Write);
    let e =
        t.p.connect(&t.d.address(), vec![(t.d_mem.0, 4096)], &key(9))
            .expect_err("a wrong key");
    assert!(e.contains("no admission has that id and proof"), "{e}");

    // The right id with a wrong proof (a recorded id, no key).
    let mut c = TcpStream::connect(parse_address(&t.d.address()).expect("address")).expect("dialled");
    let mut hello = [0u8; 48];
    c.read_exact(&mut hello).expect("greeting");
    c.write_all(&greeting_answer(&key(1), &key(9), &hello[16..], &[5; 32]))
        .expect("sent");
    let refused = read_plain_status(&mut c, Instant::now() + SECOND)
        .expect("answered")
        .expect_err("refused");
    assert!(refused.contains("no admission has that id and proof"), "{refused}");
    let _ = c.write_all(&header(OP_PUT, t.d_mem.0, 8));
    let _ = c.write_all(&[0xee; 8]);
    thread::sleep(Duration::from_millis(100));
    assert!(bytes(&t.d_mem.1).iter().all(|b| *b == 0), "nothing was written");

    // A proof for another nonce (replayed) fails the same way.
    let mut c = TcpStream::connect(parse_address(&t.d.address()).expect("address")).expect("dialled");
    c.read_exact(&mut hello).expect("greeting");
    c.write_all(&greeting_answer(&key(1), &key(1), &[0u8; 32], &[5; 32]))
        .expect("sent");
    assert!(
        read_plain_status(&mut c, Instant::now() + SECOND)
            .expect("answered")
            .is_err()
    );

    // The rightful peer still gets in.
    t.p.connect(&t.d.address(), vec![(t.d_mem.0, 4096)], &key(1))
        .expect("the admitted peer connects");
}

#[test]
fn an_admission_holds_its_newest_connection_per_lane_and_its_drop_closes_them() {
    let mut t = pair(Access::Write);
    let first =
        t.p.connect(&t.d.address(), vec![(t.d_mem.0, 4096)], &key(1))
            .expect("connected");
    // The link's peer dials again (its first connection's other end may have vanished without
    // a word): the newer connection replaces the older, which the listener closes.
    let second =
        t.p.connect(&t.d.address(), vec![(t.d_mem.0, 4096)], &key(1))
            .expect("a second connection");
    let first_conn = |t: &Pair| {
        lock(&t.p.inner.peers)[&first].lanes[0]
            .conn
            .lock()
            .expect("lock")
            .as_ref()
            .map(|c| c.sock.local_addr().expect("address"))
    };
    let before = first_conn(&t);
    // The replaced one's next op finds it closed, and goes through on a new connection (which
    // replaces the newer in turn): still one at a time.
    assert_eq!(
        t.p.put(first, &[7], &[op(t.p_mem.0, t.d_mem.0 + 16, 8)], false, SECOND),
        Ok(8)
    );
    assert_ne!(first_conn(&t), before, "dialled again");
    t.p.disconnect(first);
    assert_eq!(
        t.p.put(second, &[7], &[op(t.p_mem.0, t.d_mem.0, 8)], false, SECOND),
        Ok(8)
    );
    assert_eq!(
        lock(&t.d.inner.admitted).values().map(|a| a.conns.len()).sum::<usize>(),
        1,
        "one connection at a time on a lane (small ops use lane 0 alone)"
    );
    drop(t.admission.take());
    let e =
        t.p.put(second, &[7], &[op(t.p_mem.0, t.d_mem.0 + 8, 8)], false, SECOND)
            .expect_err("the link is gone");
    assert!(matches!(e, OpError::Failed(_)), "{e}");
    // Dialling again finds no admission.
    let e =
        t.p.put(second, &[7], &[op(t.p_mem.0, t.d_mem.0 + 8, 8)], false, SECOND)
            .expect_err("revoked");
    assert!(e.to_string().contains("no admission"), "{e}");
    assert!(bytes(&t.d_mem.1)[8..16].iter().all(|b| *b == 0));
    assert!(bytes(&t.d_mem.1)[24..].iter().all(|b| *b == 0));
    let e =
        t.p.connect(&t.d.address(), vec![(t.d_mem.0, 4096)], &key(1))
            .expect_err("revoked");
    assert!(e.contains("no admission"), "{e}");
}

#[test]
fn an_op_that_finds_its_connection_closed_dials_again() {
    let t = pair(Access::Write);
    let peer =
        t.p.connect(&t.d.address(), vec![(t.d_mem.0, 4096)], &key(1))
            .expect("connected");
    // An op that runs out of time closes its connection (the peer may hold half a frame)...
    let e =
        t.p.put(peer, &[7], &[op(t.p_mem.0, t.d_mem.0, 8)], false, Duration::ZERO)
            .expect_err("no time");
    assert!(matches!(e, OpError::Timeout(_)), "{e}");
    assert!(
        lock(&t.p.inner.peers)[&peer].lanes[0]
            .conn
            .lock()
            .expect("lock")
            .is_none(),
        "closed"
    );
    // ...and the next op of the link dials again and goes through.
    assert_eq!(
        t.p.put(peer, &[7], &[op(t.p_mem.0, t.d_mem.0 + 64, 8)], false, SECOND),
        Ok(8)
    );
    assert!(bytes(&t.d_mem.1)[64..72].iter().all(|b| *b == 0xab));
    assert!(
        bytes(&t.d_mem.1)[..64].iter().all(|b| *b == 0),
        "the timed-out op wrote nothing"
    );

    // A refusal after which the peer closes (a write on a read admission) closes ours too: the
    // next op dials again, not into the closed connection.
    let admission = t.p.admit(&key(2), &[7], Access::Read).expect("admitted");
    admission.windows.allow("lent", vec![(t.p_mem.0, 4096)]);
    let peer =
        t.d.connect(&t.p.address(), vec![(t.p_mem.0, 4096)], &key(2))
            .expect("connected");
    let e =
        t.d.put(peer, &[1], &[op(t.d_mem.0, t.p_mem.0, 8)], false, SECOND)
            .expect_err("a write on a read admission");
    assert!(e.to_string().contains("may not write"), "{e}");
    assert_eq!(t.d.get(peer, &[1], &[op(t.d_mem.0 + 256, t.p_mem.0, 8)], SECOND), Ok(8));
    assert!(bytes(&t.d_mem.1)[256..264].iter().all(|b| *b == 0xab));
}

/// A peer that proved its admission and then sends its own headers: the listener checks each.
/// A dialler's answer to a greeting with nonce `theirs`: the admission id of `id_key`, our
/// nonce `ours`, and a proof with `proof_key`.
fn greeting_answer(id_key: &[u8; 32], proof_key: &[u8; 32], theirs: &[u8], ours: &[u8; 32]) -> Vec<u8> {
    lane_answer(id_key, proof_key, theirs, ours, 0, 0)
}

/// [`greeting_answer`] on lane `lane`, its proof made for lane `proved`.
fn lane_answer(
    id_key: &[u8; 32],
    proof_key: &[u8; 32],
    theirs: &[u8],
    ours: &[u8; 32],
    lane: u8,
    proved: u8,
) -> Vec<u8> {
    let mut answer = MAGIC.to_vec();
    answer.extend_from_slice(&admission_id(id_key));
    answer.push(lane);
    answer.extend_from_slice(ours);
    answer.extend_from_slice(&proof(proof_key, theirs, ours, proved));
    answer
}

fn forged(t: &Pair, k: &[u8; 32]) -> Conn {
    let mut c = TcpStream::connect(parse_address(&t.d.address()).expect("address")).expect("dialled");
    let mut hello = [0u8; 48];
    c.read_exact(&mut hello).expect("greeting");
    c.write_all(&greeting_answer(k, k, &hello[16..], &[5; 32]))
        .expect("sent");
    read_plain_status(&mut c, Instant::now() + SECOND)
        .expect("answered")
        .expect("admitted");
    let mut accepted = [0u8; 32];
    c.read_exact(&mut accepted).expect("the listener's proof");
    let salt = [&hello[16..], &[5; 32][..]].concat();
    Conn::new(c, k, &salt, Side::Dialler)
}

/// Within 5 s: a listener that takes what it should refuse answers nothing; fail, do not hang.
fn answer(c: &mut Conn) -> Result<(), Refusal> {
    c.deadline = Some(Instant::now() + Duration::from_secs(5));
    read_status(c).expect("answered")
}

#[test]
fn an_admitted_peer_cannot_write_or_read_outside_its_regions_or_access() {
    let t = pair(Access::Write);
    // Another region of decode's, registered but not admitted to this link.
    let other = region(&t.d, 2, 4096, 0x11);
    for (addr, len, what) in [
        (other.0, 8, "outside the memory this link was admitted to"),
        (t.d_mem.0 + 4090, 8, "outside the memory"),
        (t.d_mem.0 - 1, 8, "outside the memory"),
        (u64::MAX - 3, 8, "outside the memory"),
        (t.d_mem.0, 0, "outside the memory"),
    ] {
        let mut c = forged(&t, &key(1));
        let _ = c.send_op(&header(OP_PUT, addr, len), len.min(8), |_, into| {
            into.fill(0xee);
            Ok(())
        });
        let e = answer(&mut c).expect_err("refused").why;
        assert!(e.contains(what), "{addr:#x}+{len}: {e}");
    }
    assert!(bytes(&t.d_mem.1).iter().all(|b| *b == 0));
    assert!(bytes(&other.1).iter().all(|b| *b == 0x11));

    // A write-only admission serves no reads; a bad header is refused.
    for h in [
        header(OP_GET, t.d_mem.0, 8),
        {
            let mut h = header(OP_FLUSH, 0, 0);
            h[3] = 1;
            h
        },
        header(9, 0, 0),
    ] {
        let mut c = forged(&t, &key(1));
        c.send(&h).expect("sent");
        assert!(answer(&mut c).is_err(), "{h:?}");
    }
}

#[test]
fn ops_are_checked_on_the_dialling_side_too() {
    let t = pair(Access::Write);
    let peer =
        t.p.connect(&t.d.address(), vec![(t.d_mem.0, 4096)], &key(1))
            .expect("connected");
    let e =
        t.p.put(peer, &[7], &[op(t.p_mem.0 + 4000, t.d_mem.0, 200)], false, SECOND)
            .expect_err("local");
    assert!(e.to_string().contains("outside the registered regions"), "{e}");
    let e =
        t.p.put(peer, &[7], &[op(t.p_mem.0, t.d_mem.0 + 4000, 200)], false, SECOND)
            .expect_err("remote");
    assert!(e.to_string().contains("outside the peer's regions"), "{e}");
    let e =
        t.p.put(peer, &[8], &[op(t.p_mem.0, t.d_mem.0, 8)], false, SECOND)
            .expect_err("region");
    assert!(e.to_string().contains("unknown region 8"), "{e}");
    assert!(bytes(&t.d_mem.1).iter().all(|b| *b == 0));
}

/// A stream of one lane (the fake listener takes one connection) with a 64 MiB region (its
/// base), connected (the peer) to a listener that proves the key and then reads nothing for
/// `hold` (its thread); the peer's region is at 0x1000_0000.
fn silent_peer(hold: Duration) -> (Stream, u64, u64, thread::JoinHandle<()>) {
    let p = Stream::with_lanes(LOOPBACK, 1).expect("stream");
    let big = region(&p, 1, 64 << 20, 1);
    let silent = TcpListener::bind((LOOPBACK, 0)).expect("listener");
    let at = silent.local_addr().expect("address");
    let held = thread::spawn(move || {
        let c = fake_accept(&silent, &key(3), true);
        thread::sleep(hold);
        drop(c);
    });
    let peer = p
        .connect(
            format!("{ADDRESS_PREFIX}{at}").as_bytes(),
            vec![(0x1000_0000, 64 << 20)],
            &key(3),
        )
        .expect("connected");
    (p, big.0, peer, held)
}

#[test]
fn a_peer_that_stops_reading_fails_the_put_at_its_deadline() {
    let (p, big, peer, held) = silent_peer(Duration::from_secs(3));
    let started = Instant::now();
    let e = p
        .put(
            peer,
            &[1],
            &[op(big, 0x1000_0000, 64 << 20)],
            false,
            Duration::from_millis(300),
        )
        .expect_err("never read");
    assert!(matches!(e, OpError::Timeout(_)), "{e}");
    assert!(started.elapsed() < Duration::from_secs(3), "{:?}", started.elapsed());
    held.join().expect("joined");
}

#[test]
fn addresses_parse_strictly() {
    assert_eq!(
        parse_address(b"pdpair-tcp:10.0.0.1:4000").expect("ok"),
        "10.0.0.1:4000".parse::<SocketAddr>().expect("ok")
    );
    for bad in [
        &b"pdpair-tcp:10.0.0.1"[..],
        b"pdpair-tcp:",
        b"tcp:10.0.0.1:4000",
        b"pdpair-tcp:\xff",
    ] {
        assert!(parse_address(bad).is_err(), "{bad:?}");
    }
}

#[test]
fn a_write_outside_every_open_window_is_dropped_and_the_connection_stays() {
    let t = pair(Access::Write);
    let w = t.admission.as_ref().expect("admitted").windows.clone();
    w.close("all");
    // Request r: bytes 0..1024 and 3000..3100 of the pool.
    w.allow(
        "r",
        vec![(t.d_mem.0 + 512, 512), (t.d_mem.0, 512), (t.d_mem.0 + 3000, 100)],
    );
    let peer =
        t.p.connect(&t.d.address(), vec![(t.d_mem.0, 4096)], &key(1))
            .expect("connected");
    let put = |at: u64, len: u64| {
        t.p.put(peer, &[7], &[op(t.p_mem.0, t.d_mem.0 + at, len)], false, SECOND)
    };
    assert_eq!(put(0, 1024), Ok(1024), "the merged window");
    assert_eq!(put(3000, 100), Ok(100));
    for (at, len) in [(1000, 100), (2048, 64), (3050, 100), (4000, 96)] {
        let e = put(at, len).expect_err("outside the windows");
        assert!(
            e.to_string().contains("outside every block this link was asked for"),
            "{at}+{len}: {e}"
        );
    }
    let got = bytes(&t.d_mem.1);
    assert!(got[..1024].iter().all(|b| *b == 0xab) && got[3000..3100].iter().all(|b| *b == 0xab));
    assert!(
        got[1024..3000].iter().all(|b| *b == 0) && got[3100..].iter().all(|b| *b == 0),
        "nothing else written"
    );
    // The connection stayed: the window still takes writes; closed, it takes none.
    assert_eq!(put(100, 8), Ok(8));
    w.close("r");
    let e = put(100, 8).expect_err("closed");
    assert!(e.to_string().contains("outside every block"), "{e}");
    assert!(w.requests().is_empty());
}

#[test]
fn windows_merge_touching_ranges_and_check_without_overflow() {
    let w = Windows::default();
    w.allow("a", vec![(100, 10), (110, 10), (50, 0), (200, 5), (u64::MAX - 4, 4)]);
    assert!(w.contains(100, 20), "merged");
    assert!(!w.contains(100, 21));
    assert!(!w.contains(50, 1), "empty ranges open nothing");
    assert!(w.contains(201, 4) && !w.contains(199, 2));
    assert!(w.contains(u64::MAX - 4, 4) && !w.contains(u64::MAX - 4, 5));
    w.allow("b", vec![(300, 10)]);
    w.allow("a", vec![(400, 10)]);
    assert!(
        !w.contains(100, 1) && w.contains(400, 10) && w.contains(300, 10),
        "replaced, not added"
    );
}

#[test]
fn a_read_outside_every_lent_block_is_refused_without_a_byte() {
    // Pull, with the pair's roles as the fixture names them: `p` reads `d`'s region, which `d`
    // admitted to reads; only the bytes `d` lent the link are served.
    let t = pair(Access::Read);
    let w = t.admission.as_ref().expect("admitted").windows.clone();
    w.close("all");
    w.allow("r", vec![(t.d_mem.0 + 1024, 1024)]);
    // The reader's memory: zeroed, so a refused read shows it took nothing.
    let into = region(&t.p, 8, 4096, 0);
    let peer =
        t.p.connect(&t.d.address(), vec![(t.d_mem.0, 4096)], &key(1))
            .expect("connected");
    let get = |at: u64, len: u64| t.p.get(peer, &[8], &[op(into.0 + at, t.d_mem.0 + at, len)], SECOND);
    // Mark the lent bytes, then read them.
    // SAFETY: the mapping is alive and nothing else touches it during the test.
    unsafe { std::ptr::write_bytes((t.d_mem.0 + 1024) as *mut u8, 0x5a, 1024) };
    assert_eq!(get(1024, 1024), Ok(1024));
    for (at, len) in [(0, 64), (1000, 100), (2040, 16), (3000, 64)] {
        let e = get(at, len).expect_err("outside the lent blocks");
        assert!(
            e.to_string().contains("outside every block lent to this link"),
            "{at}+{len}: {e}"
        );
    }
    let got = bytes(&into.1);
    assert!(got[1024..2048].iter().all(|b| *b == 0x5a));
    assert!(
        got[..1024].iter().all(|b| *b == 0) && got[2048..].iter().all(|b| *b == 0),
        "nothing else read"
    );
    // Still served (the reader dials again after a refusal); closed, nothing is.
    assert_eq!(get(1500, 8), Ok(8));
    w.close("r");
    let e = get(1500, 8).expect_err("closed");
    assert!(e.to_string().contains("outside every block lent"), "{e}");
}

/// A relay from a listener of its own to `to`, as someone on the path: every byte either way is
/// recorded, and the dialler's byte at offset `flip` (in that direction) is changed. The
/// relay's stream address.
fn relay(to: SocketAddr, flip: Option<usize>, seen: Arc<Mutex<Vec<u8>>>) -> Vec<u8> {
    let listener = TcpListener::bind((LOOPBACK, 0)).expect("relay");
    let at = listener.local_addr().expect("address");
    thread::spawn(move || {
        let (down, _) = listener.accept().expect("accepted");
        let up = TcpStream::connect(to).expect("upstream");
        let pump = |mut from: TcpStream, mut into: TcpStream, flip: Option<usize>, seen: Arc<Mutex<Vec<u8>>>| {
            thread::spawn(move || {
                let (mut buf, mut offset) = (vec![0u8; 64 << 10], 0usize);
                while let Ok(n) = from.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    if let Some(f) = flip
                        && (offset..offset + n).contains(&f)
                    {
                        buf[f - offset] ^= 0x01;
                    }
                    offset += n;
                    lock(&seen).extend_from_slice(&buf[..n]);
                    if into.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
                let _ = into.shutdown(Shutdown::Write);
            })
        };
        pump(
            down.try_clone().expect("clone"),
            up.try_clone().expect("clone"),
            flip,
            seen.clone(),
        );
        pump(up, down, None, seen);
    });
    format!("{ADDRESS_PREFIX}{at}").into_bytes()
}

#[test]
fn a_byte_changed_on_the_way_fails_its_record_and_nothing_lands() {
    let t = pair(Access::Write);
    let to = parse_address(&t.d.address()).expect("address");
    // The dialler's answer to the greeting, the PUT's header record (24 + 16), then its bytes' record:
    // one bit of the bytes' ciphertext changed, and in another run one of the header's.
    for flip in [ANSWER_LEN + 40 + 10, ANSWER_LEN + 12] {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let via = relay(to, Some(flip), seen);
        let peer = t.p.connect(&via, vec![(t.d_mem.0, 4096)], &key(1)).expect("connected");
        let e =
            t.p.put(peer, &[7], &[op(t.p_mem.0, t.d_mem.0 + 512, 64)], false, SECOND)
                .expect_err("a changed record");
        assert!(e.to_string().contains("failed its authentication"), "byte {flip}: {e}");
        assert!(bytes(&t.d_mem.1).iter().all(|b| *b == 0), "byte {flip}: nothing landed");
        t.p.disconnect(peer);
    }
}

#[test]
fn the_stream_carries_no_kv_or_address_in_the_clear() {
    let t = pair(Access::Write);
    let to = parse_address(&t.d.address()).expect("address");
    let seen = Arc::new(Mutex::new(Vec::new()));
    let via = relay(to, None, seen.clone());
    let peer = t.p.connect(&via, vec![(t.d_mem.0, 4096)], &key(1)).expect("connected");
    assert_eq!(
        t.p.put(peer, &[7], &[op(t.p_mem.0, t.d_mem.0, 4096)], false, SECOND),
        Ok(4096)
    );
    assert!(bytes(&t.d_mem.1).iter().all(|b| *b == 0xab), "the bytes landed");
    let seen = lock(&seen).clone();
    assert!(seen.len() > 4096, "the relay carried the put ({} bytes)", seen.len());
    let run = [0xabu8; 16];
    assert!(!seen.windows(16).any(|w| w == run), "the KV went in the clear");
    let target = t.d_mem.0.to_be_bytes();
    assert!(!seen.windows(8).any(|w| w == target), "the header went in the clear");
}

/// A listener of its own that takes one dialler's proof without checking it and answers as an
/// admitting listener would: with the listener's proof of `k` (`prove`), or with a forged one.
fn fake_accept(l: &TcpListener, k: &[u8; 32], prove: bool) -> TcpStream {
    let (mut c, _) = l.accept().expect("accepted");
    let mut hello = MAGIC.to_vec();
    hello.extend_from_slice(&[0; 32]);
    c.write_all(&hello).expect("greeting");
    let mut answer = [0u8; ANSWER_LEN];
    c.read_exact(&mut answer).expect("proof");
    let accepted: [u8; 32] = if prove {
        accept_mac(k, &[0; 32], &answer[33..65]).finalize().into_bytes().into()
    } else {
        [0u8; 32]
    };
    c.write_all(&[&[OK][..], &accepted].concat()).expect("ok");
    c
}

#[test]
fn a_listener_that_does_not_prove_the_key_is_not_dialled_into() {
    // Someone on the path answers in the listener's place (it cannot know the key): the dialler
    // sends nothing more.
    let p = Stream::start(LOOPBACK).expect("stream");
    let fake = TcpListener::bind((LOOPBACK, 0)).expect("listener");
    let at = fake.local_addr().expect("address");
    let held = thread::spawn(move || fake_accept(&fake, &key(3), false));
    let e = p
        .connect(
            format!("{ADDRESS_PREFIX}{at}").as_bytes(),
            vec![(0x1000_0000, 4096)],
            &key(3),
        )
        .expect_err("an unproven listener");
    assert!(e.contains("did not prove the key"), "{e}");
    drop(held.join().expect("joined"));
}

#[test]
fn connecting_to_a_listener_that_never_greets_ends_at_the_callers_deadline() {
    // The handshake's deadline, shorter than the listener's proof window: connecting is part of
    // setting up the link, which the pair's handshakeTimeout bounds.
    let p = Stream::start(LOOPBACK).expect("stream");
    let mute = TcpListener::bind((LOOPBACK, 0)).expect("listener");
    let at = mute.local_addr().expect("address");
    let held = thread::spawn(move || mute.accept().map(|(c, _)| (c, mute)));
    let started = Instant::now();
    let e = p
        .connect_by(
            format!("{ADDRESS_PREFIX}{at}").as_bytes(),
            vec![(0x1000_0000, 4096)],
            &key(3),
            started + Duration::from_millis(300),
        )
        .expect_err("a listener that says nothing");
    // Not a speed check: the listener's window is PROOF_WITHIN (5 s); without the caller's
    // deadline the dial waits all of it.
    assert!(
        started.elapsed() < PROOF_WITHIN / 2,
        "took {:?}: {e}",
        started.elapsed()
    );
    drop(held.join().expect("joined"));
}

#[test]
fn a_peer_that_reads_a_byte_at_a_time_fails_the_put_at_its_deadline() {
    // One lane: the slow listener takes one connection.
    let p = Stream::with_lanes(LOOPBACK, 1).expect("stream");
    let big = region(&p, 1, 16 << 20, 1);
    let slow = TcpListener::bind((LOOPBACK, 0)).expect("listener");
    let at = slow.local_addr().expect("address");
    let held = thread::spawn(move || {
        let mut c = fake_accept(&slow, &key(3), true);
        let _ = c.set_read_timeout(Some(Duration::from_millis(100)));
        let (started, mut b) = (Instant::now(), vec![0u8; 64 << 10]);
        // Let the socket's buffers fill, then trickle: 64 KiB every 900 ms, for 3 s.
        thread::sleep(Duration::from_millis(200));
        while started.elapsed() < Duration::from_secs(3) {
            match c.read(&mut b) {
                Ok(0) => break,
                Err(e) if e.kind() != io::ErrorKind::WouldBlock && e.kind() != io::ErrorKind::TimedOut => break,
                _ => thread::sleep(Duration::from_millis(900)),
            }
        }
    });
    let peer = p
        .connect(
            format!("{ADDRESS_PREFIX}{at}").as_bytes(),
            vec![(0x1000_0000, 16 << 20)],
            &key(3),
        )
        .expect("connected");
    let started = Instant::now();
    let e = p
        .put(peer, &[1], &[op(big.0, 0x1000_0000, 16 << 20)], false, SECOND)
        .expect_err("trickled");
    assert!(matches!(e, OpError::Timeout(_)), "{e}");
    assert!(
        started.elapsed() < Duration::from_millis(2500),
        "{:?}",
        started.elapsed()
    );
    held.join().expect("joined");
}

#[test]
fn a_window_closed_while_a_write_runs_takes_no_more_of_it() {
    let d = Stream::start(LOOPBACK).expect("stream");
    let len = 2 * seal::CHUNK;
    let mem = region(&d, 1, len, 0);
    let admission = d.admit(&key(1), &[1], Access::Write).expect("admitted");
    admission.windows.allow("r", vec![(mem.0, len as u64)]);
    let t = Pair {
        p: Stream::start(LOOPBACK).expect("stream"),
        p_mem: (0, mem.1.clone()),
        d_mem: mem.clone(),
        d,
        admission: Some(admission),
    };
    // An insider sends the header of a write over the whole window and its first piece...
    let mut c = forged(&t, &key(1));
    c.send(&header(OP_PUT, mem.0, len as u64)).expect("header");
    c.send(&vec![0xee; seal::CHUNK]).expect("first piece");
    let until = Instant::now() + Duration::from_secs(5);
    while bytes(&mem.1)[seal::CHUNK - 1] != 0xee {
        assert!(Instant::now() < until, "the first piece lands");
        thread::sleep(Duration::from_millis(10));
    }
    // ...the request ends (its blocks may go to another request), then the rest comes.
    t.admission.as_ref().expect("admitted").windows.close("r");
    c.send(&vec![0xee; seal::CHUNK]).expect("second piece");
    c.send(&header(OP_FLUSH, 0, 0)).expect("flush");
    let e = answer(&mut c).expect_err("dropped").why;
    assert!(e.contains("outside every block this link was asked for"), "{e}");
    let got = bytes(&mem.1);
    assert!(got[..seal::CHUNK].iter().all(|b| *b == 0xee));
    assert!(got[seal::CHUNK..].iter().all(|b| *b == 0), "nothing after the close");
}

#[test]
fn a_window_closed_while_a_read_runs_gives_no_more_of_it() {
    let t = pair(Access::Read);
    let len = 64usize << 20;
    let big = region(&t.d, 9, len, 0x77);
    // A read admission of its own, over the big region alone.
    drop(t.admission);
    let admission = t.d.admit(&key(4), &[9], Access::Read).expect("admitted");
    admission.windows.allow("r", vec![(big.0, len as u64)]);
    let t = Pair {
        admission: Some(admission),
        ..t
    };
    let mut c = forged(&t, &key(4));
    c.send(&header(OP_GET, big.0, len as u64)).expect("header");
    c.deadline = Some(Instant::now() + Duration::from_secs(10));
    read_status(&mut c).expect("answered").expect("served");
    // The reader takes the first piece, then the request ends; the listener has sealed at
    // most what the sockets buffer, and no more after the close.
    c.recv(seal::CHUNK).expect("first piece");
    t.admission.as_ref().expect("admitted").windows.close("r");
    let mut read = seal::CHUNK;
    while read < len && c.recv((len - read).min(seal::CHUNK)).is_ok() {
        read += seal::CHUNK;
    }
    assert!(read < len / 2, "{read} of {len} bytes read after the close");
}

#[test]
fn an_op_on_a_connection_the_peer_dropped_goes_through_on_a_new_one() {
    let t = pair(Access::Write);
    let peer =
        t.p.connect(&t.d.address(), vec![(t.d_mem.0, 4096)], &key(1))
            .expect("connected");
    assert_eq!(
        t.p.put(peer, &[7], &[op(t.p_mem.0, t.d_mem.0, 8)], false, SECOND),
        Ok(8)
    );
    // The idle connection is dropped under the link (by the listener here; a firewall that
    // forgets idle connections does the same): the next op finds it gone, dials again and
    // goes through, not failing its request.
    let (_, c) = lock(&t.d.inner.admitted)[&admission_id(&key(1))]
        .conns
        .get(&0)
        .map(|(s, c)| (*s, c.try_clone().expect("clone")))
        .expect("connected");
    c.shutdown(Shutdown::Both).expect("dropped");
    thread::sleep(Duration::from_millis(50));
    assert_eq!(
        t.p.put(peer, &[7], &[op(t.p_mem.0, t.d_mem.0 + 64, 8)], false, SECOND),
        Ok(8)
    );
    assert!(bytes(&t.d_mem.1)[64..72].iter().all(|b| *b == 0xab));
}

/// Stands in for a GPU's memory (there is none here): `len` bytes at addresses reserved with no
/// access in this process, so a direct copy there would fault; reached only through the
/// copier, whose writes land at `settle`, as a GPU copy from pageable memory may land later.
struct FakeDevice {
    base: u64,
    len: usize,
    mem: Mutex<Vec<u8>>,
    pending: Mutex<Vec<(u64, Vec<u8>)>>,
}

impl FakeDevice {
    fn new(len: usize, fill: u8) -> Arc<FakeDevice> {
        // SAFETY: a fresh private reservation, never accessed (PROT_NONE).
        let at = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(at, libc::MAP_FAILED, "reserving addresses");
        Arc::new(FakeDevice {
            base: at as u64,
            len,
            mem: Mutex::new(vec![fill; len]),
            pending: Mutex::new(Vec::new()),
        })
    }

    fn offset(&self, at: u64, len: usize) -> Result<usize, String> {
        let off = at.checked_sub(self.base).ok_or("below the device region")? as usize;
        (off + len <= self.len)
            .then_some(off)
            .ok_or_else(|| "past the device region".into())
    }

    fn bytes(&self) -> Vec<u8> {
        lock(&self.mem).clone()
    }

    fn register(self: &Arc<Self>, s: &Stream, id: u64) {
        s.register_device(id, self.base, self.len as u64, self.clone(), self.clone());
    }
}

impl DeviceCopy for FakeDevice {
    fn read(&self, at: u64, into: &mut [u8]) -> Result<(), String> {
        let off = self.offset(at, into.len())?;
        into.copy_from_slice(&lock(&self.mem)[off..off + into.len()]);
        Ok(())
    }

    fn write(&self, at: u64, from: &[u8]) -> Result<(), String> {
        self.offset(at, from.len())?;
        lock(&self.pending).push((at, from.to_vec()));
        Ok(())
    }

    fn settle(&self) -> Result<(), String> {
        let mut mem = lock(&self.mem);
        for (at, data) in lock(&self.pending).drain(..) {
            let off = (at - self.base) as usize;
            mem[off..off + data.len()].copy_from_slice(&data);
        }
        Ok(())
    }
}

#[test]
fn device_memory_is_staged_through_its_copier_and_has_landed_when_the_op_answers() {
    let d = Stream::start(LOOPBACK).expect("decode's stream");
    let p = Stream::start(LOOPBACK).expect("prefill's stream");
    let len = 1 << 20;
    let d_dev = FakeDevice::new(len, 0);
    let p_dev = FakeDevice::new(len, 0);
    {
        let mut m = lock(&p_dev.mem);
        for (i, b) in m.iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
    }
    d_dev.register(&d, 1);
    p_dev.register(&p, 7);
    let expected = p_dev.bytes();

    // Push: prefill's device bytes into decode's, across several 256 KiB pieces; landed (settled)
    // when the put returns.
    let admission = d.admit(&key(1), &[1], Access::Write).expect("admitted");
    admission.windows.allow("r", vec![(d_dev.base, len as u64)]);
    let peer = p
        .connect(&d.address(), vec![(d_dev.base, len as u64)], &key(1))
        .expect("connected");
    let n = p
        .put(
            peer,
            &[7],
            &[
                op(p_dev.base, d_dev.base, 700_000),
                op(p_dev.base + 800_000, d_dev.base + 800_000, 1000),
            ],
            false,
            SECOND * 5,
        )
        .expect("written");
    assert_eq!(n, 701_000);
    let got = d_dev.bytes();
    assert_eq!(got[..700_000], expected[..700_000]);
    assert_eq!(got[800_000..801_000], expected[800_000..801_000]);
    assert!(got[700_000..800_000].iter().all(|b| *b == 0) && got[801_000..].iter().all(|b| *b == 0));
    drop(admission);

    // A write outside every window is dropped: nothing reaches the device.
    let admission = d.admit(&key(3), &[1], Access::Write).expect("admitted");
    admission.windows.allow("r", vec![(d_dev.base, 4096)]);
    let peer = p
        .connect(&d.address(), vec![(d_dev.base, len as u64)], &key(3))
        .expect("connected");
    let e = p
        .put(
            peer,
            &[7],
            &[op(p_dev.base, d_dev.base + 900_000, 64)],
            false,
            SECOND * 5,
        )
        .expect_err("outside the windows");
    assert!(e.to_string().contains("outside every block"), "{e}");
    assert!(d_dev.bytes()[900_000..900_064].iter().all(|b| *b == 0));
    assert!(lock(&d_dev.pending).is_empty());
    drop(admission);

    // Pull: decode reads prefill's device bytes into its own; landed when the get returns.
    let admission = p.admit(&key(2), &[7], Access::Read).expect("admitted");
    admission.windows.allow("lent", vec![(p_dev.base, len as u64)]);
    let peer = d
        .connect(&p.address(), vec![(p_dev.base, len as u64)], &key(2))
        .expect("connected");
    let n = d
        .get(
            peer,
            &[1],
            &[op(d_dev.base + 900_000, p_dev.base + 10, 100_000)],
            SECOND * 5,
        )
        .expect("read");
    assert_eq!(n, 100_000);
    assert_eq!(d_dev.bytes()[900_000..1_000_000], expected[10..100_010]);
    drop(admission);
}

#[test]
fn a_read_whose_blocks_are_taken_back_midway_fails_saying_so() {
    let d = Stream::start(LOOPBACK).expect("prefill's stream");
    let p = Stream::start(LOOPBACK).expect("decode's stream");
    let len = 64usize << 20;
    let src = region(&d, 1, len, 0x77);
    let dst = region(&p, 7, len, 0);
    let admission = d.admit(&key(1), &[1], Access::Read).expect("admitted");
    admission.windows.allow("r", vec![(src.0, len as u64)]);
    let peer = p
        .connect(&d.address(), vec![(src.0, len as u64)], &key(1))
        .expect("connected");
    // The blocks are taken back once the first bytes of the read have landed.
    let windows = admission.windows.clone();
    let first = dst.1.clone();
    let closer = thread::spawn(move || {
        let start = Instant::now();
        // SAFETY: the mapping is alive; a volatile read of a byte another thread writes.
        while unsafe { std::ptr::read_volatile(first.as_ptr()) } != 0x77 && start.elapsed() < SECOND * 20 {
            thread::sleep(Duration::from_micros(50));
        }
        windows.close("r");
    });
    let e = p
        .get(peer, &[7], &[op(dst.0, src.0, len as u64)], SECOND * 30)
        .expect_err("taken back midway");
    closer.join().expect("closer");
    assert!(
        e.to_string().contains("outside every block lent to this link now"),
        "{e}"
    );
    assert!(
        bytes(&dst.1)[len - 4096..].iter().all(|b| *b == 0),
        "the end was not read"
    );
}

#[test]
fn ops_split_into_contiguous_lane_shares_cut_at_record_multiples() {
    let mib = 1u64 << 20;
    // 64 writes of 8 MiB over 4 lanes: 128 MiB each, whole ops.
    let ops: Vec<PutOp> = (0..64)
        .map(|i| op(i * 8 * mib, (1 << 40) + i * 8 * mib, 8 * mib))
        .collect();
    let shares = split(&ops, 4);
    assert_eq!(shares.len(), 4);
    for share in &shares {
        assert_eq!(share.iter().map(|(_, _, o)| o.len).sum::<u64>(), 128 * mib);
    }
    // Every byte once, in order, each part where its op puts it.
    let parts: Vec<&Part> = shares.iter().flatten().collect();
    let mut at = (0usize, 0u64);
    for (i, from, part) in parts {
        assert_eq!((*i, *from), at, "contiguous");
        let whole = &ops[*i];
        assert_eq!((part.local, part.remote), (whole.local + from, whole.remote + from));
        at = if from + part.len == whole.len {
            (i + 1, 0)
        } else {
            (*i, from + part.len)
        };
    }
    assert_eq!(at, (64, 0));
    // One op of 40 MiB over 4 lanes: cut where each share ends, at record multiples.
    let shares = split(&[op(0, 0, 40 * mib)], 4);
    assert_eq!(shares.len(), 4);
    for share in &shares[..3] {
        assert_eq!(share[0].2.len % seal::CHUNK as u64, 0);
        assert_eq!(share[0].2.len, 10 * mib);
    }
    // Small lists take fewer lanes (each at least MIN_LANE_BYTES), an empty one a flush alone.
    assert_eq!(split(&[op(0, 0, MIN_LANE_BYTES * 2 - 1)], 4).len(), 1);
    assert_eq!(split(&[op(0, 0, MIN_LANE_BYTES * 3)], 4).len(), 3);
    assert_eq!(split(&[op(0, 0, 100), op(200, 200, 50)], 4).len(), 1);
    assert_eq!(split(&[], 4), vec![Vec::new()]);
    assert_eq!(split(&ops, 1).len(), 1);
}

#[test]
fn a_large_put_and_get_go_over_every_lane_each_on_its_own_connection() {
    let len = 64usize << 20;
    let d = Stream::with_lanes(LOOPBACK, 4).expect("decode's stream");
    let p = Stream::with_lanes(LOOPBACK, 4).expect("prefill's stream");
    let d_mem = region(&d, 1, len, 0);
    let p_mem = region(&p, 7, len, 0);
    // A pattern that tells every 8 bytes apart: a part landing in another part's place shows.
    // SAFETY: the mapping is alive, len bytes, and nothing else touches it yet.
    let src = unsafe { std::slice::from_raw_parts_mut(p_mem.1.as_mut_ptr(), len) };
    for (i, w) in src.chunks_exact_mut(8).enumerate() {
        w.copy_from_slice(&(i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15).to_le_bytes());
    }
    let admission = d.admit(&key(1), &[1], Access::Write).expect("admitted");
    admission.windows.allow("r", vec![(d_mem.0, len as u64)]);
    let peer = p
        .connect(&d.address(), vec![(d_mem.0, len as u64)], &key(1))
        .expect("connected");
    // Two ops, one in reverse halves: 64 MiB over 4 lanes.
    let half = len as u64 / 2;
    let ops = [op(p_mem.0 + half, d_mem.0, half), op(p_mem.0, d_mem.0 + half, half)];
    assert_eq!(p.put(peer, &[7], &ops, false, 10 * SECOND), Ok(len as u64));
    let got = bytes(&d_mem.1);
    assert!(got[..half as usize] == src[half as usize..] && got[half as usize..] == src[..half as usize]);
    assert_eq!(
        lock(&d.inner.admitted)[&admission_id(&key(1))].conns.len(),
        4,
        "one connection per lane"
    );
    // And back, read from a read admission over the lanes.
    let back = p.admit(&key(2), &[7], Access::Read).expect("admitted");
    back.windows.allow("lent", vec![(p_mem.0, len as u64)]);
    let peer = d
        .connect(&p.address(), vec![(p_mem.0, len as u64)], &key(2))
        .expect("connected");
    // SAFETY: as above: nothing writes decode's region while the stream is idle.
    unsafe { std::ptr::write_bytes(d_mem.1.as_mut_ptr(), 0, len) };
    assert_eq!(
        d.get(peer, &[1], &[op(d_mem.0, p_mem.0, len as u64)], 10 * SECOND),
        Ok(len as u64)
    );
    assert!(bytes(&d_mem.1) == src, "every byte read back in place");
    assert_eq!(lock(&p.inner.admitted)[&admission_id(&key(2))].conns.len(), 4);
    // A window closed under one lane fails the whole op, saying so.
    admission.windows.close("r");
    admission.windows.allow("r", vec![(d_mem.0, half)]);
    let e = p
        .put(peer_of(&p, &d), &[7], &ops, false, 10 * SECOND)
        .expect_err("refused");
    assert!(
        e.to_string().contains("outside every block this link was asked for"),
        "{e}"
    );
}

/// `p`'s (only) peer connected to `d`.
fn peer_of(p: &Stream, d: &Stream) -> u64 {
    let at = parse_address(&d.address()).expect("address");
    *lock(&p.inner.peers)
        .iter()
        .find(|(_, c)| c.at == at)
        .map(|(id, _)| id)
        .expect("a peer")
}

#[test]
fn a_lane_is_bound_by_the_proof_and_an_admission_holds_a_bounded_number() {
    let t = pair(Access::Write);
    let dial = |lane: u8, proved: u8| {
        let mut c = TcpStream::connect(parse_address(&t.d.address()).expect("address")).expect("dialled");
        let mut hello = [0u8; 48];
        c.read_exact(&mut hello).expect("greeting");
        c.write_all(&lane_answer(&key(1), &key(1), &hello[16..], &[5; 32], lane, proved))
            .expect("sent");
        read_plain_status(&mut c, Instant::now() + SECOND)
            .expect("answered")
            .map(|()| c)
    };
    // A lane changed on the way (a proof for lane 0 sent as lane 1) is refused.
    let e = dial(1, 0).expect_err("refused");
    assert!(e.contains("no admission has that id and proof"), "{e}");
    // No lane past the ones an admission holds, even proved.
    let e = dial(MAX_LANES as u8, MAX_LANES as u8).expect_err("refused");
    assert!(e.contains("the lane is past"), "{e}");
    // Each lane holds its newest connection: MAX_LANES at most, however many are dialled (the
    // older one on a lane is closed by the listener).
    let held: Vec<TcpStream> = (0..MAX_LANES as u8)
        .chain(0..MAX_LANES as u8)
        .map(|lane| dial(lane, lane).expect("admitted"))
        .collect();
    thread::sleep(Duration::from_millis(50));
    assert_eq!(lock(&t.d.inner.admitted)[&admission_id(&key(1))].conns.len(), MAX_LANES);
    let mut first = held[0].try_clone().expect("clone");
    first.set_read_timeout(Some(SECOND)).expect("timeout");
    // Its proof, then the end (not a read timeout: the listener shut it).
    let mut rest = Vec::new();
    let end = first.read_to_end(&mut rest);
    assert!(
        end.is_ok() || end.as_ref().is_err_and(|e| e.kind() == io::ErrorKind::ConnectionReset),
        "replaced on its lane, closed: {end:?}"
    );
    let mut last = held[MAX_LANES].try_clone().expect("clone");
    last.set_read_timeout(Some(Duration::from_millis(200)))
        .expect("timeout");
    let e = last.read_to_end(&mut Vec::new()).expect_err("the newest stays open");
    assert!(
        matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut),
        "{e}"
    );
    assert!(Stream::with_lanes(LOOPBACK, MAX_LANES + 1).is_err());
    assert!(Stream::with_lanes(LOOPBACK, 0).is_err());
}

#[test]
fn a_lane_that_cannot_be_dialled_has_its_share_go_over_lane_0() {
    let len = 32usize << 20;
    let d = Stream::start(LOOPBACK).expect("decode's stream");
    let p = Stream::with_lanes(LOOPBACK, 4).expect("prefill's stream");
    let d_mem = region(&d, 1, len, 0);
    let p_mem = region(&p, 7, len, 0x5a);
    let admission = d.admit(&key(1), &[1], Access::Write).expect("admitted");
    admission.windows.allow("r", vec![(d_mem.0, len as u64)]);
    let peer = p
        .connect(&d.address(), vec![(d_mem.0, len as u64)], &key(1))
        .expect("connected");
    // Many links dialling at once from this address fill the listener's cap on connections
    // waiting for their proof: here, connections that never prove anything hold it.
    let at = parse_address(&d.address()).expect("address");
    let hogs: Vec<TcpStream> = (0..MAX_UNPROVEN_FROM)
        .map(|_| TcpStream::connect(at).expect("a hog"))
        .collect();
    thread::sleep(Duration::from_millis(100));
    assert_eq!(
        p.put(peer, &[7], &[op(p_mem.0, d_mem.0, len as u64)], false, 10 * SECOND),
        Ok(len as u64),
        "the shares of the lanes the listener turned away went over lane 0"
    );
    assert!(bytes(&d_mem.1).iter().all(|b| *b == 0x5a), "every byte landed");
    assert_eq!(
        lock(&d.inner.admitted)[&admission_id(&key(1))].conns.len(),
        1,
        "lane 0 alone"
    );
    drop(hogs);
}

#[test]
fn a_link_turned_away_while_its_sources_unproven_places_are_taken_dials_again_within_its_time() {
    // Many links between two agents dialling at once can take the listener's places for
    // connections from one address waiting for their proof; one past them is closed before its
    // greeting. Lanes past 0 fall back to lane 0, which had nothing to fall back to: the link's
    // handshake failed. It is dialled again, a little later each time, within its time.
    let d = Stream::start(LOOPBACK).expect("decode's stream");
    let p = Stream::start(LOOPBACK).expect("prefill's stream");
    let d_mem = region(&d, 1, 4096, 0);
    let _admission = d.admit(&key(1), &[1], Access::Write).expect("admitted");
    let at = parse_address(&d.address()).expect("address");
    let hogs: Vec<TcpStream> = (0..MAX_UNPROVEN_FROM)
        .map(|_| TcpStream::connect(at).expect("a hog"))
        .collect();
    thread::sleep(Duration::from_millis(100));
    // The places free a moment later (other links' proofs done).
    let freed = thread::spawn(move || {
        thread::sleep(Duration::from_millis(300));
        drop(hogs);
    });
    let connected = p.connect(&d.address(), vec![(d_mem.0, 4096)], &key(1));
    freed.join().expect("hogs");
    assert!(connected.is_ok(), "{connected:?}");
}

#[test]
fn a_piece_written_into_device_memory_has_landed_before_its_window_can_close() {
    // The stand-in device lands writes only at `settle` (as a copy from pageable memory may land
    // after it returns): a piece the windows let through must have landed before their lock
    // goes, or a close that returned could still see it land in blocks gone to another request.
    let d = Stream::start(LOOPBACK).expect("stream");
    let len = 2 * seal::CHUNK;
    let dev = FakeDevice::new(len, 0);
    dev.register(&d, 1);
    let admission = d.admit(&key(1), &[1], Access::Write).expect("admitted");
    admission.windows.allow("r", vec![(dev.base, len as u64)]);
    let t = Pair {
        p: Stream::start(LOOPBACK).expect("stream"),
        p_mem: region(&d, 2, 4096, 0),
        d_mem: region(&d, 3, 4096, 0),
        d,
        admission: Some(admission),
    };
    let mut c = forged(&t, &key(1));
    c.send(&header(OP_PUT, dev.base, len as u64)).expect("header");
    c.send(&vec![0xee; seal::CHUNK]).expect("first piece");
    // No flush: the piece lands on its own.
    let until = Instant::now() + Duration::from_secs(5);
    while dev.bytes()[seal::CHUNK - 1] != 0xee {
        assert!(Instant::now() < until, "the piece landed without a flush");
        thread::sleep(Duration::from_millis(10));
    }
    assert!(lock(&dev.pending).is_empty(), "nothing still landing");
}

#[test]
fn a_disconnect_ends_an_op_stuck_on_a_silent_peer_at_once() {
    let (p, big, peer, held) = silent_peer(Duration::from_secs(12));
    let p = Arc::new(p);
    let started = Instant::now();
    let putter = {
        let p = p.clone();
        thread::spawn(move || {
            let r = p.put(peer, &[1], &[op(big, 0x1000_0000, 64 << 20)], false, 10 * SECOND);
            (r, started.elapsed())
        })
    };
    thread::sleep(Duration::from_millis(300));
    // The link goes (its peer is lost, say): the put holding the lane must not keep it, nor
    // the caller, until its deadline.
    let asked = Instant::now();
    p.disconnect(peer);
    assert!(asked.elapsed() < 2 * SECOND, "disconnect waited {:?}", asked.elapsed());
    let (r, took) = putter.join().expect("joined");
    assert!(r.is_err(), "{r:?}");
    assert!(
        took < 3 * SECOND,
        "the put ended {took:?} after it started, not at its 10 s deadline"
    );
    drop(held);
}

#[test]
fn block_windows_hold_the_block_ids_and_admit_exactly_their_pieces() {
    // K then V arrays per layer (vLLM's FLASH_ATTN cache): 2 layers, 8 blocks of 16 bytes.
    let (n, len) = (8u32, 16u64);
    let k = |layer: u64| 1000 + layer * 2 * 8 * len;
    let v = |layer: u64| k(layer) + 8 * len;
    let pieces: Vec<(u64, u64, u64)> = (0..2)
        .flat_map(|l| [(k(l), k(l) + len, len), (v(l), v(l) + len, len)])
        .collect();
    let arrays = std::sync::Arc::new(Arrays::of(&pieces, n).expect("arrays"));
    let w = Windows::default();
    w.allow_blocks("r", arrays.clone(), vec![5, 2, 3, 2]);
    for l in 0..2 {
        for base in [k(l), v(l)] {
            assert!(w.contains(base + 2 * len, len), "block 2");
            assert!(w.contains(base + 2 * len + 3, 4), "inside block 2");
            assert!(w.contains(base + 2 * len, 2 * len), "blocks 2 and 3 together");
            assert!(!w.contains(base + 2 * len, 3 * len), "2, 3 and 4 (not lent)");
            assert!(!w.contains(base + 4 * len, 1), "block 4");
            assert!(w.contains(base + 5 * len, len) && !w.contains(base + 5 * len, len + 1));
            assert!(!w.contains(base, 1) && !w.contains(base + 7 * len, len));
        }
    }
    assert!(!w.contains(k(0) - 1, 2), "before the arrays");
    assert!(!w.contains(v(1) + 8 * len, 1), "past them");
    assert!(!w.contains(u64::MAX - 2, 4), "no overflow");
    // K and V of each block side by side (FlashInfer's [num_blocks, 2, ...]): one array per
    // layer, a block's K and V together admitted as one piece.
    let kv = |layer: u64| 50_000 + layer * 8 * 2 * len;
    let pieces: Vec<(u64, u64, u64)> = (0..2)
        .flat_map(|l| [(kv(l), kv(l) + 2 * len, len), (kv(l) + len, kv(l) + 3 * len, len)])
        .collect();
    let arrays = std::sync::Arc::new(Arrays::of(&pieces, n).expect("arrays"));
    assert_eq!(arrays.0.len(), 2, "{arrays:?}");
    w.allow_blocks("fi", arrays, vec![1, 6]);
    assert!(w.contains(kv(1) + 2 * len, 2 * len), "block 1's K and V");
    assert!(w.contains(kv(1) + 3 * len, len), "block 1's V");
    assert!(!w.contains(kv(1) + 2 * len, 3 * len), "into block 2");
    assert!(!w.contains(kv(0), len) && !w.contains(kv(0) + 12 * len, 4 * len));
    assert!(w.contains(kv(0) + 12 * len, 2 * len), "block 6");
    // Closed, nothing.
    w.close("r");
    w.close("fi");
    assert!(!w.contains(k(0) + 2 * len, 1));
    // What does not make arrays that stay apart is refused (windows then take ranges).
    assert!(
        Arrays::of(&[(100, 116, 16), (108, 124, 16)], 8).is_none(),
        "pieces overlap"
    );
    assert!(Arrays::of(&[(100, 110, 16)], 8).is_none(), "a piece past its period");
    assert!(
        Arrays::of(&[(100, 116, 16), (150, 166, 16)], 8).is_none(),
        "arrays overlap"
    );
    assert!(Arrays::of(&[(100, 116, 16)], 1).is_none(), "one block: no period");
    assert!(
        Arrays::of(&[(u64::MAX - 40, u64::MAX - 24, 16)], 8).is_none(),
        "past the address space"
    );
}
