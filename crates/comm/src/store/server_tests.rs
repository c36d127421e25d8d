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
