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
    // A request of the link's over all of the region (the windows' own test narrows them).
    if let Some(w) = &admission.windows {
        w.allow("all", vec![(d_mem.0, 4096)]);
    }
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
    assert!(e.contains("no admission has that id"), "{e}");

    // The right id with a wrong proof (a recorded id, no key).
    let mut c = TcpStream::connect(parse_address(&t.d.address()).expect("address")).expect("dialled");
    let mut hello = [0u8; 48];
    c.read_exact(&mut hello).expect("greeting");
    let mut answer = MAGIC.to_vec();
    answer.extend_from_slice(&admission_id(&key(1)));
    answer.extend_from_slice(&proof(&key(9), &hello[16..]));
    c.write_all(&answer).expect("sent");
    let refused = read_status(&mut c).expect("answered").expect_err("refused");
    assert!(refused.contains("the proof is wrong"), "{refused}");
    let _ = c.write_all(&header(OP_PUT, t.d_mem.0, 8));
    let _ = c.write_all(&[0xee; 8]);
    thread::sleep(Duration::from_millis(100));
    assert!(bytes(&t.d_mem.1).iter().all(|b| *b == 0), "nothing was written");

    // A proof for another nonce (replayed) fails the same way.
    let mut c = TcpStream::connect(parse_address(&t.d.address()).expect("address")).expect("dialled");
    c.read_exact(&mut hello).expect("greeting");
    let mut answer = MAGIC.to_vec();
    answer.extend_from_slice(&admission_id(&key(1)));
    answer.extend_from_slice(&proof(&key(1), &[0u8; 32]));
    c.write_all(&answer).expect("sent");
    assert!(read_status(&mut c).expect("answered").is_err());

    // The rightful peer still gets in.
    t.p.connect(&t.d.address(), vec![(t.d_mem.0, 4096)], &key(1))
        .expect("the admitted peer connects");
}

#[test]
fn an_admission_takes_one_connection_and_its_drop_closes_it() {
    let mut t = pair(Access::Write);
    let peer =
        t.p.connect(&t.d.address(), vec![(t.d_mem.0, 4096)], &key(1))
            .expect("connected");
    let e =
        t.p.connect(&t.d.address(), vec![(t.d_mem.0, 4096)], &key(1))
            .expect_err("a second connection");
    assert!(e.contains("already has a connection"), "{e}");
    t.p.put(peer, &[7], &[op(t.p_mem.0, t.d_mem.0, 8)], false, SECOND)
        .expect("written");
    drop(t.admission.take());
    let e =
        t.p.put(peer, &[7], &[op(t.p_mem.0, t.d_mem.0 + 8, 8)], false, SECOND)
            .expect_err("the link is gone");
    assert!(matches!(e, OpError::Failed(_)), "{e}");
    assert!(bytes(&t.d_mem.1)[8..16].iter().all(|b| *b == 0));
    let e =
        t.p.connect(&t.d.address(), vec![(t.d_mem.0, 4096)], &key(1))
            .expect_err("revoked");
    assert!(e.contains("no admission"), "{e}");
}

/// A peer that proved its admission and then sends its own headers: the listener checks each.
fn forged(t: &Pair, k: &[u8; 32]) -> TcpStream {
    let mut c = TcpStream::connect(parse_address(&t.d.address()).expect("address")).expect("dialled");
    let mut hello = [0u8; 48];
    c.read_exact(&mut hello).expect("greeting");
    let mut answer = MAGIC.to_vec();
    answer.extend_from_slice(&admission_id(k));
    answer.extend_from_slice(&proof(k, &hello[16..]));
    c.write_all(&answer).expect("sent");
    read_status(&mut c).expect("answered").expect("admitted");
    // A listener that takes what it should refuse answers nothing: fail, do not hang.
    c.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    c
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
        c.write_all(&header(OP_PUT, addr, len)).expect("sent");
        let _ = c.write_all(&[0xee; 8]);
        let e = read_status(&mut c).expect("answered").expect_err("refused");
        assert!(e.contains(what), "{addr:#x}+{len}: {e}");
        // The admission stays, its connection is gone: the link may not dial again.
        lock(&t.d.inner.admitted)
            .get_mut(&admission_id(&key(1)))
            .expect("admitted")
            .conn = None;
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
        c.write_all(&h).expect("sent");
        assert!(read_status(&mut c).expect("answered").is_err(), "{h:?}");
        lock(&t.d.inner.admitted)
            .get_mut(&admission_id(&key(1)))
            .expect("admitted")
            .conn = None;
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

#[test]
fn a_peer_that_stops_reading_fails_the_put_at_its_deadline() {
    let p = Stream::start(LOOPBACK).expect("stream");
    let big = region(&p, 1, 64 << 20, 1);
    let silent = TcpListener::bind((LOOPBACK, 0)).expect("listener");
    let at = silent.local_addr().expect("address");
    let held = thread::spawn(move || {
        let (mut c, _) = silent.accept().expect("accepted");
        let mut hello = MAGIC.to_vec();
        hello.extend_from_slice(&[0; 32]);
        c.write_all(&hello).expect("greeting");
        let mut answer = [0u8; 64];
        c.read_exact(&mut answer).expect("proof");
        c.write_all(&[OK]).expect("ok");
        thread::sleep(Duration::from_secs(3));
        drop(c);
    });
    let peer = p
        .connect(
            format!("{ADDRESS_PREFIX}{at}").as_bytes(),
            vec![(0x1000_0000, 64 << 20)],
            &key(3),
        )
        .expect("connected");
    let started = Instant::now();
    let e = p
        .put(
            peer,
            &[1],
            &[op(big.0, 0x1000_0000, 64 << 20)],
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
fn unproven_connections_are_bounded() {
    let d = Stream::start(LOOPBACK).expect("stream");
    let at = parse_address(&d.address()).expect("address");
    let idle: Vec<TcpStream> = (0..MAX_UNPROVEN)
        .map(|_| TcpStream::connect(at).expect("dialled"))
        .collect();
    // Each got its greeting: all are being served.
    for mut c in &idle {
        let mut hello = [0u8; 48];
        c.read_exact(&mut hello).expect("greeting");
    }
    let mut over = TcpStream::connect(at).expect("dialled");
    over.set_read_timeout(Some(SECOND)).expect("timeout");
    let mut b = [0u8; 1];
    assert_eq!(over.read(&mut b).expect("closed, not served"), 0);
    drop(idle);
}

#[test]
fn a_write_outside_every_open_window_is_dropped_and_the_connection_stays() {
    let t = pair(Access::Write);
    let w = t
        .admission
        .as_ref()
        .and_then(|a| a.windows.clone())
        .expect("a write admission has windows");
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
