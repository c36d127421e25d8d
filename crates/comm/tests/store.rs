//! Integration tests of the rendezvous store: a real server on a loopback port per test, real
//! clients, and raw TCP peers that skip, garble or abuse the protocol.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use comm::CommError;
use comm::store::auth::{self, ANSWER_LEN, GREETING_LEN, REFUSED};
use comm::store::proto::{self, Op, Request, Response};
use comm::store::{Secret, ServerOptions, StoreClient, StoreServer};

const CONNECT: Duration = Duration::from_secs(2);

fn loopback() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

fn secret() -> Secret {
    Secret::new(b"test-secret".to_vec()).unwrap()
}

fn server() -> StoreServer {
    StoreServer::bind(loopback(), secret()).unwrap()
}

fn client(server: &StoreServer) -> StoreClient {
    StoreClient::connect(server.local_addr(), &secret(), 0, CONNECT).unwrap()
}

/// A raw socket that completed the handshake (to send hand-made frames).
fn authenticated_raw(server: &StoreServer) -> TcpStream {
    let mut s = TcpStream::connect(server.local_addr()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    auth::client_handshake(&mut s, &secret()).unwrap();
    s
}

/// Reads until the server closes the connection (error or EOF), returning what arrived.
fn read_until_closed(s: &mut TcpStream) -> Vec<u8> {
    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let start = Instant::now();
    let mut all = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return all,
            Ok(n) => all.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return all,
            Err(e) => panic!(
                "server did not close the connection: {e} after {:?}",
                start.elapsed()
            ),
        }
    }
}

fn set_frame(key: &str, value: &[u8], generation: u64) -> Vec<u8> {
    proto::encode_request(&Request {
        generation,
        op: Op::Set { key, value },
    })
    .unwrap()
}

#[test]
fn set_get_delete_num_keys() {
    let srv = server();
    let c = client(&srv);
    assert_eq!(c.get("a").unwrap(), None);
    c.set("a", b"1").unwrap();
    c.set("b", b"").unwrap();
    c.set("a", b"2").unwrap();
    assert_eq!(c.get("a").unwrap().as_deref(), Some(&b"2"[..]));
    assert_eq!(c.get("b").unwrap().as_deref(), Some(&b""[..]));
    assert_eq!(c.num_keys().unwrap(), 2);
    assert!(c.delete("a").unwrap());
    assert!(!c.delete("a").unwrap());
    assert_eq!(c.num_keys().unwrap(), 1);
    // Bad arguments are refused client-side and leave the connection usable.
    assert!(matches!(
        c.set("", b"x"),
        Err(CommError::InvalidArgument(_))
    ));
    let long_key = "k".repeat(5000);
    assert!(matches!(
        c.get(&long_key),
        Err(CommError::InvalidArgument(_))
    ));
    assert_eq!(c.num_keys().unwrap(), 1);
}

#[test]
fn large_values_round_trip_and_oversized_ones_are_refused() {
    let srv = server();
    let c = client(&srv);
    let big: Vec<u8> = (0..16 << 20).map(|i: u32| (i % 251) as u8).collect();
    c.set("big", &big).unwrap();
    assert!(c.get("big").unwrap().unwrap() == big);
    let too_big = vec![0u8; proto::MAX_VALUE_LEN + 1];
    assert!(matches!(
        c.set("huge", &too_big),
        Err(CommError::InvalidArgument(_))
    ));
    assert_eq!(c.num_keys().unwrap(), 1);
}

#[test]
fn add_is_readable_decimal() {
    let srv = server();
    let c = client(&srv);
    assert_eq!(c.add("n", 5).unwrap(), 5);
    assert_eq!(c.add("n", -2).unwrap(), 3);
    assert_eq!(c.get("n").unwrap().unwrap(), b"3");
    c.set("text", b"hello").unwrap();
    let err = c.add("text", 1).unwrap_err();
    assert!(err.to_string().contains("not a decimal integer"), "{err}");
    assert_eq!(c.get("text").unwrap().unwrap(), b"hello");
}

#[test]
fn compare_set_semantics() {
    let srv = server();
    let c = client(&srv);
    // Absent and expected absent: set.
    assert_eq!(c.compare_set("k", None, b"v1").unwrap().unwrap(), b"v1");
    // Present but expected absent: unchanged, returns the current value.
    assert_eq!(c.compare_set("k", None, b"v2").unwrap().unwrap(), b"v1");
    // Wrong expectation: unchanged.
    assert_eq!(
        c.compare_set("k", Some(b"zz"), b"v2").unwrap().unwrap(),
        b"v1"
    );
    // Right expectation: swapped.
    assert_eq!(
        c.compare_set("k", Some(b"v1"), b"v2").unwrap().unwrap(),
        b"v2"
    );
    assert_eq!(c.get("k").unwrap().unwrap(), b"v2");
    // Absent with an expected value: stays absent.
    assert_eq!(c.compare_set("other", Some(b"x"), b"y").unwrap(), None);
    assert_eq!(c.get("other").unwrap(), None);
}

#[test]
fn wait_is_satisfied_by_another_thread() {
    let srv = server();
    let c = client(&srv);
    let writer = c.try_clone().unwrap();
    let t = thread::spawn(move || {
        thread::sleep(Duration::from_millis(100));
        writer.set("late", b"here").unwrap();
        writer.set("later", b"too").unwrap();
    });
    c.set("early", b"e").unwrap();
    let start = Instant::now();
    let values = c
        .wait(&["early", "late", "later"], Duration::from_secs(5))
        .unwrap();
    assert_eq!(
        values,
        vec![b"e".to_vec(), b"here".to_vec(), b"too".to_vec()]
    );
    assert!(start.elapsed() < Duration::from_secs(2));
    assert_eq!(
        c.wait_one("late", Duration::from_millis(10)).unwrap(),
        b"here"
    );
    t.join().unwrap();
}

#[test]
fn wait_timeout_names_the_missing_key() {
    let srv = server();
    let c = client(&srv);
    c.set("present", b"1").unwrap();
    let start = Instant::now();
    let err = c
        .wait(&["present", "rank3/addr"], Duration::from_millis(150))
        .unwrap_err();
    let elapsed = start.elapsed();
    assert!(elapsed >= Duration::from_millis(140), "{elapsed:?}");
    assert!(elapsed < Duration::from_secs(2), "{elapsed:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("rank3/addr") && !msg.contains("\"present\""),
        "{msg}"
    );
    // The connection is still fine after a timeout.
    assert_eq!(c.get("present").unwrap().unwrap(), b"1");
}

#[test]
fn concurrent_adds_give_the_exact_total() {
    let srv = server();
    let shared = Arc::new(client(&srv));
    let mut threads = Vec::new();
    for i in 0..16 {
        // Half the threads have their own connection, half share one.
        let c = if i % 2 == 0 {
            Arc::new(shared.try_clone().unwrap())
        } else {
            Arc::clone(&shared)
        };
        threads.push(thread::spawn(move || {
            for _ in 0..50 {
                c.add("counter", 1).unwrap();
            }
            c.add("counter", i).unwrap();
        }));
    }
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(
        shared.add("counter", 0).unwrap(),
        16 * 50 + (0..16).sum::<i64>()
    );
}

#[test]
fn wrong_secret_is_refused() {
    let srv = server();
    let bad = Secret::new(b"not-the-secret".to_vec()).unwrap();
    let start = Instant::now();
    let err = StoreClient::connect(srv.local_addr(), &bad, 0, Duration::from_secs(5)).unwrap_err();
    assert!(matches!(err, CommError::Auth(_)), "{err}");
    // Not retried until the connect timeout.
    assert!(start.elapsed() < Duration::from_secs(1));
    assert_eq!(client(&srv).num_keys().unwrap(), 0);
}

#[test]
fn client_refuses_a_server_without_the_secret() {
    // A fake server that greets correctly, accepts any proof and sends a garbage proof back.
    let listener = TcpListener::bind(loopback()).unwrap();
    let addr = listener.local_addr().unwrap();
    let fake = thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut greeting = auth::GREETING_MAGIC.to_vec();
        greeting.extend_from_slice(&[7u8; 32]);
        s.write_all(&greeting).unwrap();
        let mut answer = [0u8; ANSWER_LEN];
        s.read_exact(&mut answer).unwrap();
        s.write_all(&[auth::ACCEPTED]).unwrap();
        s.write_all(&[0u8; 32]).unwrap();
    });
    let err = StoreClient::connect(addr, &secret(), 0, CONNECT).unwrap_err();
    assert!(matches!(err, CommError::Auth(_)), "{err}");
    fake.join().unwrap();
}

#[test]
fn raw_clients_that_skip_or_garble_the_handshake_change_nothing() {
    let srv = server();
    // 1. Skip the handshake: send a SET frame (padded past the answer's size) right away.
    let mut s = TcpStream::connect(srv.local_addr()).unwrap();
    let mut frame = set_frame("owned", b"by-attacker", 0);
    frame.extend_from_slice(&set_frame("owned2", &[b'x'; 100], 0));
    s.write_all(&frame).unwrap();
    let got = read_until_closed(&mut s);
    assert!(got.is_empty() || got.starts_with(&auth::GREETING_MAGIC));
    assert!(
        got.len() <= GREETING_LEN + 1,
        "server answered more than a refusal"
    );

    // 2. Garble the handshake: a random nonce and a wrong proof, then a SET.
    let mut s = TcpStream::connect(srv.local_addr()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let mut greeting = [0u8; GREETING_LEN];
    s.read_exact(&mut greeting).unwrap();
    s.write_all(&[0x5a; ANSWER_LEN]).unwrap();
    let mut verdict = [0u8; 1];
    s.read_exact(&mut verdict).unwrap();
    assert_eq!(verdict[0], REFUSED);
    let _ = s.write_all(&set_frame("owned", b"by-attacker", 0));
    read_until_closed(&mut s);

    // 3. Replay a proof made with the wrong secret.
    let mut s = TcpStream::connect(srv.local_addr()).unwrap();
    let wrong = Secret::new(b"guess".to_vec()).unwrap();
    assert!(matches!(
        auth::client_handshake(&mut s, &wrong),
        Err(CommError::Auth(_))
    ));
    let _ = s.write_all(&set_frame("owned", b"by-attacker", 0));

    let c = client(&srv);
    assert_eq!(c.get("owned").unwrap(), None);
    assert_eq!(c.get("owned2").unwrap(), None);
    assert_eq!(c.num_keys().unwrap(), 0);
}

#[test]
fn silent_client_is_dropped_after_the_handshake_timeout() {
    let opts = ServerOptions {
        handshake_timeout: Duration::from_millis(200),
        ..ServerOptions::default()
    };
    let srv = StoreServer::bind_with(loopback(), secret(), opts).unwrap();
    let mut silent = TcpStream::connect(srv.local_addr()).unwrap();
    let start = Instant::now();
    let got = read_until_closed(&mut silent);
    assert_eq!(got.len(), GREETING_LEN);
    assert!(
        start.elapsed() < Duration::from_secs(1),
        "{:?}",
        start.elapsed()
    );
    // Meanwhile and afterwards, real clients are served.
    assert_eq!(client(&srv).add("x", 1).unwrap(), 1);
}

#[test]
fn hostile_and_truncated_frames_are_rejected_and_the_server_keeps_serving() {
    let srv = server();
    let good = client(&srv);
    good.set("before", b"1").unwrap();

    // Frame length u32::MAX.
    let mut s = authenticated_raw(&srv);
    s.write_all(&u32::MAX.to_le_bytes()).unwrap();
    read_until_closed(&mut s);

    // A u64::MAX length field (its first four bytes already exceed the limit).
    let mut s = authenticated_raw(&srv);
    s.write_all(&u64::MAX.to_le_bytes()).unwrap();
    read_until_closed(&mut s);

    // A frame just over the limit.
    let mut s = authenticated_raw(&srv);
    s.write_all(&((proto::MAX_FRAME_LEN + 1) as u32).to_le_bytes())
        .unwrap();
    read_until_closed(&mut s);

    // A SET whose value length field is u32::MAX inside a small frame: an error reply, then close.
    let mut s = authenticated_raw(&srv);
    let mut body = vec![1u8];
    body.extend_from_slice(&0u64.to_le_bytes());
    body.extend_from_slice(&1u32.to_le_bytes());
    body.push(b'z');
    body.extend_from_slice(&u32::MAX.to_le_bytes());
    body.extend_from_slice(b"short");
    let mut frame = (body.len() as u32).to_le_bytes().to_vec();
    frame.extend_from_slice(&body);
    s.write_all(&frame).unwrap();
    let reply = read_until_closed(&mut s);
    let resp = proto::decode_response(&reply[4..]).unwrap();
    assert!(matches!(resp, Response::Error(_)), "{resp:?}");

    // A truncated frame: announces 1000 bytes, sends 10, then closes its side.
    let mut s = authenticated_raw(&srv);
    s.write_all(&1000u32.to_le_bytes()).unwrap();
    s.write_all(&[1u8; 10]).unwrap();
    s.shutdown(Shutdown::Write).unwrap();
    read_until_closed(&mut s);

    // An unknown op code.
    let mut s = authenticated_raw(&srv);
    s.write_all(&[9, 0, 0, 0, 200, 0, 0, 0, 0, 0, 0, 0, 0])
        .unwrap();
    read_until_closed(&mut s);

    // Nothing was applied, and the server still serves, including the old connection.
    assert_eq!(good.get("z").unwrap(), None);
    assert_eq!(good.get("before").unwrap().unwrap(), b"1");
    assert_eq!(client(&srv).num_keys().unwrap(), 1);
}

#[test]
fn stale_generation_is_fenced_off() {
    let srv = server();
    let old = client(&srv);
    let launcher = client(&srv);
    old.set("k", b"gen0").unwrap();
    assert_eq!(launcher.generation().unwrap(), 0);
    assert_eq!(launcher.bump_generation(0).unwrap(), 1);
    assert_eq!(launcher.generation().unwrap(), 1);

    // The old client's write is refused and not applied.
    let err = old.set("k", b"stale").unwrap_err();
    assert!(
        matches!(err, CommError::StaleGeneration { got: 0, current: 1 }),
        "{err}"
    );
    assert!(matches!(
        old.get("k"),
        Err(CommError::StaleGeneration { .. })
    ));
    assert!(matches!(
        old.add("n", 1),
        Err(CommError::StaleGeneration { .. })
    ));

    // A stale CAS on the generation changes nothing.
    assert!(matches!(
        old.bump_generation(0),
        Err(CommError::StaleGeneration { got: 0, current: 1 })
    ));
    assert!(matches!(old.bump_generation(5), Err(CommError::Store(_))));
    assert_eq!(old.generation().unwrap(), 1);

    // A client stamped ahead of the store is refused too.
    let ahead = StoreClient::connect(srv.local_addr(), &secret(), 2, CONNECT).unwrap();
    let err = ahead.set("k", b"future").unwrap_err();
    assert!(
        matches!(err, CommError::Store(_)) && err.to_string().contains("newer"),
        "{err}"
    );

    // After joining the new generation, the old client works again.
    old.set_generation(1);
    assert_eq!(old.stamp(), 1);
    assert_eq!(old.get("k").unwrap().unwrap(), b"gen0");
    old.set("k", b"gen1").unwrap();
    assert_eq!(old.get("k").unwrap().unwrap(), b"gen1");
}

#[test]
fn bump_wakes_a_stale_waiter() {
    let srv = server();
    let waiter = client(&srv);
    let launcher = client(&srv);
    let t = thread::spawn(move || waiter.wait_one("never", Duration::from_secs(10)));
    thread::sleep(Duration::from_millis(100));
    let start = Instant::now();
    launcher.bump_generation(0).unwrap();
    let err = t.join().unwrap().unwrap_err();
    assert!(
        matches!(err, CommError::StaleGeneration { got: 0, current: 1 }),
        "{err}"
    );
    assert!(start.elapsed() < Duration::from_secs(2));
}

#[test]
fn connect_retries_until_the_server_is_up() {
    // Find a free port, then start the server on it a little later.
    let addr = TcpListener::bind(loopback()).unwrap().local_addr().unwrap();
    let t = thread::spawn(move || {
        thread::sleep(Duration::from_millis(300));
        let srv = StoreServer::bind(addr, secret()).unwrap();
        thread::sleep(Duration::from_millis(500));
        drop(srv);
    });
    let c = StoreClient::connect(addr, &secret(), 0, Duration::from_secs(3)).unwrap();
    c.set("up", b"yes").unwrap();
    t.join().unwrap();
}

#[test]
fn connect_gives_up_naming_the_address() {
    let addr = TcpListener::bind(loopback()).unwrap().local_addr().unwrap();
    let start = Instant::now();
    let err = StoreClient::connect(addr, &secret(), 0, Duration::from_millis(300)).unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(2));
    assert!(err.to_string().contains(&addr.to_string()), "{err}");
}

#[test]
fn shutdown_ends_waits_and_connections() {
    let srv = server();
    let addr = srv.local_addr();
    let c = client(&srv).with_timeout(Duration::from_secs(1));
    let waiter = c.try_clone().unwrap();
    let t = thread::spawn(move || waiter.wait_one("never", Duration::from_secs(10)));
    thread::sleep(Duration::from_millis(100));
    let start = Instant::now();
    srv.shutdown();
    assert!(
        start.elapsed() < Duration::from_secs(1),
        "{:?}",
        start.elapsed()
    );
    assert!(t.join().unwrap().is_err());
    assert_eq!(srv.live_connections(), 0);
    // The old connection is gone and nobody listens any more.
    assert!(c.get("k").is_err());
    assert!(StoreClient::connect(addr, &secret(), 0, Duration::ZERO).is_err());
    drop(srv);
}

#[test]
fn client_reconnects_after_a_lost_connection() {
    let srv = server();
    let c = client(&srv).with_timeout(Duration::from_millis(500));
    c.set("a", b"1").unwrap();
    // The server goes away under the client, then comes back (empty) on the same port.
    let addr = srv.local_addr();
    drop(srv);
    assert!(c.get("a").is_err());
    let srv2 = StoreServer::bind(addr, secret()).unwrap();
    assert_eq!(c.get("a").unwrap(), None, "a fresh store is empty");
    drop(srv2);
}
