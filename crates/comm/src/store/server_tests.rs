//! Unit tests of [`super`] (kept apart to keep the module itself short).

use super::*;

fn shared() -> Shared {
    Shared {
        state: Mutex::new(State::default()),
        changed: Condvar::new(),
        secret: Secret::new(b"s".to_vec()).unwrap(),
        options: ServerOptions::default(),
        stopping: AtomicBool::new(false),
        conns: Mutex::new(HashMap::new()),
        live: AtomicUsize::new(0),
        next_id: AtomicU64::new(0),
    }
}

fn req(generation: u64, op: Op<'_>) -> Request<'_> {
    Request { generation, op }
}

#[test]
fn add_keeps_decimal_text_and_rejects_garbage() {
    let s = shared();
    assert_eq!(
        s.handle(req(0, Op::Add { key: "n", delta: 5 })),
        Response::Ok(Reply::Int(5))
    );
    assert_eq!(
        s.handle(req(
            0,
            Op::Add {
                key: "n",
                delta: -7
            }
        )),
        Response::Ok(Reply::Int(-2))
    );
    assert_eq!(
        s.handle(req(0, Op::Get { key: "n" })),
        Response::Ok(Reply::Value(Some(b"-2".to_vec())))
    );
    s.handle(req(
        0,
        Op::Set {
            key: "t",
            value: b"abc",
        },
    ));
    assert!(matches!(
        s.handle(req(0, Op::Add { key: "t", delta: 1 })),
        Response::Error(_)
    ));
    s.handle(req(
        0,
        Op::Set {
            key: "m",
            value: i64::MAX.to_string().as_bytes(),
        },
    ));
    assert!(matches!(
        s.handle(req(0, Op::Add { key: "m", delta: 1 })),
        Response::Error(_)
    ));
}

#[test]
fn fencing_and_generation_cas() {
    let s = shared();
    assert_eq!(
        s.handle(req(7, Op::BumpGeneration { expected: 0 })),
        Response::Ok(Reply::U64(1))
    );
    assert_eq!(
        s.handle(req(0, Op::BumpGeneration { expected: 0 })),
        Response::GenerationMismatch { got: 0, current: 1 }
    );
    assert_eq!(
        s.handle(req(
            0,
            Op::Set {
                key: "k",
                value: b"v"
            }
        )),
        Response::GenerationMismatch { got: 0, current: 1 }
    );
    assert_eq!(
        s.handle(req(
            2,
            Op::Set {
                key: "k",
                value: b"v"
            }
        )),
        Response::GenerationMismatch { got: 2, current: 1 }
    );
    assert_eq!(
        s.handle(req(5, Op::NumKeys)),
        Response::GenerationMismatch { got: 5, current: 1 }
    );
    assert_eq!(s.handle(req(1, Op::NumKeys)), Response::Ok(Reply::U64(0)));
    assert_eq!(
        s.handle(req(0, Op::Generation)),
        Response::Ok(Reply::U64(1))
    );
}

#[test]
fn wait_times_out_with_missing_keys_and_wakes_on_bump() {
    let s = Arc::new(shared());
    s.handle(req(
        0,
        Op::Set {
            key: "a",
            value: b"1",
        },
    ));
    let r = s.handle(req(
        0,
        Op::Wait {
            keys: vec!["a", "b"],
            timeout_ms: 20,
        },
    ));
    assert_eq!(
        r,
        Response::WaitTimeout {
            missing: vec!["b".into()]
        }
    );
    let s2 = Arc::clone(&s);
    let t = std::thread::spawn(move || {
        s2.handle(req(
            0,
            Op::Wait {
                keys: vec!["never"],
                timeout_ms: 10_000,
            },
        ))
    });
    std::thread::sleep(Duration::from_millis(50));
    let t0 = Instant::now();
    s.handle(req(0, Op::BumpGeneration { expected: 0 }));
    assert_eq!(
        t.join().unwrap(),
        Response::GenerationMismatch { got: 0, current: 1 }
    );
    assert!(t0.elapsed() < Duration::from_secs(2));
}

#[test]
fn a_fenced_store_refuses_older_stamps_and_never_goes_back() {
    let secret = Secret::new(b"0123456789abcdef0123456789abcdef".to_vec()).unwrap();
    let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), secret.clone()).unwrap();
    let old =
        crate::store::StoreClient::connect(server.local_addr(), &secret, 2, Duration::from_secs(5))
            .unwrap();
    assert_eq!(server.fence(3), 3);
    assert_eq!(server.fence(1), 3, "fencing never lowers the generation");
    assert_eq!(server.generation(), 3);
    assert!(matches!(
        old.set("k", b"v"),
        Err(CommError::StaleGeneration { got: 2, current: 3 })
    ));
    old.set_generation(3);
    old.set("k", b"v").unwrap();
    assert_eq!(old.get("k").unwrap(), Some(b"v".to_vec()));
}

#[test]
fn a_redirect_moves_a_client_and_its_clones_to_another_store() {
    let secret = Secret::new(b"0123456789abcdef0123456789abcdef".to_vec()).unwrap();
    let any = "127.0.0.1:0".parse().unwrap();
    let (a, b) = (
        StoreServer::bind(any, secret.clone()).unwrap(),
        StoreServer::bind(any, secret.clone()).unwrap(),
    );
    let client =
        crate::store::StoreClient::connect(a.local_addr(), &secret, 0, Duration::from_secs(5))
            .unwrap();
    let clone = client.try_clone().unwrap();
    client.set("where", b"a").unwrap();
    b.fence(4);
    client.redirect(b.local_addr());
    assert_eq!(
        (client.addr(), clone.addr()),
        (b.local_addr(), b.local_addr())
    );
    // The clone's open connection still reaches `a`: its next call moves it to `b`, where its
    // old stamp is refused.
    assert!(matches!(
        clone.get("where"),
        Err(CommError::StaleGeneration { got: 0, current: 4 })
    ));
    client.set_generation(4);
    assert_eq!(client.get("where").unwrap(), None);
    client.set("where", b"b").unwrap();
    drop(a);
    clone.set_generation(4);
    assert_eq!(clone.get("where").unwrap(), Some(b"b".to_vec()));
}
