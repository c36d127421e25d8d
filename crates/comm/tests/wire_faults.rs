//! The receive path against hostile or broken peers: truncated and malformed frames, absurd
//! length fields, frames of another group or an older generation, and mismatched calls. Each must
//! end in a clear error (never a panic, a hang or an allocation sized by the peer).

use comm::dtype::DType;
use comm::engine::{OpCtx, Xfer, exchange};
use comm::frame::{FrameHeader, FrameType, OpKind};
use comm::transport::Link;
use comm::transport::tcp::TcpLink;
use comm::{CommError, OpDesc};
use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

/// A TcpLink for "rank 0" and the raw socket of its "rank 1" peer.
fn pair() -> (Vec<Option<Box<dyn Link>>>, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let raw = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (s, _) = l.accept().unwrap();
    (vec![None, Some(Box::new(TcpLink::new(s).unwrap()))], raw)
}

fn ctx(timeout: Duration) -> OpCtx {
    let desc = OpDesc {
        group: "world".into(),
        kind: "all_reduce",
        seq: 7,
        bytes: 400,
        algo: "ring",
    };
    OpCtx::new(
        desc,
        OpKind::AllReduce,
        DType::F32,
        100,
        0xabc,
        3,
        0,
        2,
        timeout,
    )
}

fn good_header() -> FrameHeader {
    FrameHeader {
        frame_type: FrameType::Data,
        kind: OpKind::AllReduce,
        dtype: DType::F32,
        group_id: 0xabc,
        generation: 3,
        seq: 7,
        signature: 100,
        payload_len: 400,
        sender: 1,
        step: 0,
    }
}

/// Receives 400 bytes from rank 1 after the raw peer wrote `bytes` (and maybe closed).
fn receive_after(bytes: &[u8], close: bool) -> (Result<(), CommError>, Duration) {
    let (mut links, mut raw) = pair();
    raw.write_all(bytes).unwrap();
    if close {
        raw.shutdown(std::net::Shutdown::Write).unwrap();
    }
    let mut c = ctx(Duration::from_secs(2));
    let mut buf = vec![0u8; 400];
    let t0 = Instant::now();
    let r = exchange(
        &mut links,
        &mut c,
        &mut [Xfer::Recv {
            peer: 1,
            buf: &mut buf,
        }],
    );
    (r, t0.elapsed())
}

#[test]
fn well_formed_frame_is_accepted() {
    let mut msg = good_header().encode().to_vec();
    msg.extend_from_slice(&[7u8; 400]);
    let (r, _) = receive_after(&msg, false);
    r.unwrap();
}

#[test]
fn truncated_header_then_close_is_peer_lost() {
    let (r, el) = receive_after(&good_header().encode()[..20], true);
    let e = r.unwrap_err();
    assert!(matches!(e, CommError::PeerLost { peer: 1, .. }), "{e}");
    assert!(e.to_string().contains("all_reduce #7"), "{e}");
    assert!(el < Duration::from_secs(1));
}

#[test]
fn truncated_payload_then_close_is_peer_lost() {
    let mut msg = good_header().encode().to_vec();
    msg.extend_from_slice(&[1u8; 100]);
    let (r, _) = receive_after(&msg, true);
    assert!(matches!(
        r.unwrap_err(),
        CommError::PeerLost { peer: 1, .. }
    ));
}

#[test]
fn garbage_is_a_bad_frame() {
    let (r, _) = receive_after(&[0x47u8; 64], false);
    let e = r.unwrap_err();
    assert!(matches!(e, CommError::BadFrame { peer: 1, .. }), "{e}");
    assert!(e.to_string().contains("magic"), "{e}");
}

#[test]
fn absurd_length_is_refused_before_any_allocation() {
    for len in [u64::MAX, 1 << 41, 401] {
        let mut h = good_header();
        h.payload_len = len;
        let (r, _) = receive_after(&h.encode(), false);
        let e = r.unwrap_err();
        assert!(
            matches!(e, CommError::BadFrame { .. } | CommError::Mismatch { .. }),
            "{len}: {e}"
        );
    }
}

#[test]
fn stale_generation_is_fenced() {
    let mut h = good_header();
    h.generation = 2;
    let (r, _) = receive_after(&h.encode(), false);
    assert!(matches!(
        r.unwrap_err(),
        CommError::StaleGeneration { got: 2, current: 3 }
    ));
}

#[test]
fn other_group_is_rejected() {
    let mut h = good_header();
    h.group_id = 0xdef;
    let (r, _) = receive_after(&h.encode(), false);
    let e = r.unwrap_err();
    assert!(
        matches!(e, CommError::BadFrame { .. }) && e.to_string().contains("group"),
        "{e}"
    );
}

#[test]
fn mismatched_op_names_both_calls() {
    let mut h = good_header();
    h.kind = OpKind::AllGather;
    h.signature = 50;
    let (r, _) = receive_after(&h.encode(), false);
    let e = r.unwrap_err();
    let s = e.to_string();
    assert!(matches!(e, CommError::Mismatch { peer: 1, .. }), "{s}");
    assert!(s.contains("all_gather") && s.contains("all_reduce"), "{s}");
}

#[test]
fn silent_peer_times_out_naming_it() {
    let (r, el) = receive_after(&[], false);
    let e = r.unwrap_err();
    assert!(
        matches!(&e, CommError::Timeout { missing, .. } if missing == &vec![1]),
        "{e}"
    );
    assert!(
        el >= Duration::from_secs(2) && el < Duration::from_secs(4),
        "{el:?}"
    );
}
