//! Tests of [`super`]: plans parsed, episodes resolved, faults struck.
use super::*;

/// The one fault of generation `g` for a single node of `world` workers (the old
/// single-fault form of [`Chaos::resolve_in`]).
fn one(
    c: &Chaos,
    g: u64,
    after: u64,
    seed: u64,
    steps: u64,
    world: usize,
) -> Result<Option<Fault>> {
    let draw = Draw {
        seed,
        steps,
        nproc: world,
        members: &[0],
        partition_default: Duration::from_secs(6),
    };
    let faults = c.resolve_in(g, after, &draw)?;
    assert!(faults.len() <= 1, "{faults:?}");
    Ok(faults.first().copied())
}

#[test]
fn plans_parse_and_resolve() {
    let c = Chaos::parse("kill@4:1,corrupt-newest").unwrap();
    assert!(c.corrupt_newest);
    let f = one(&c, 0, 0, 0, 10, 2).unwrap().unwrap();
    assert_eq!(f.to_string(), "kill@4:1");
    assert_eq!(Fault::parse("kill@4:1").unwrap(), f);
    let r = Chaos::parse("hang@random").unwrap();
    for seed in 0..50 {
        let f = one(&r, 0, 0, seed, 6, 3).unwrap().unwrap();
        assert!((1..6).contains(&f.step) && f.rank < 3, "{f}");
        assert_eq!(one(&r, 0, 0, seed, 6, 3).unwrap(), Some(f), "deterministic");
    }
    assert_eq!(
        one(&Chaos::parse("corrupt-newest").unwrap(), 0, 0, 1, 5, 2).unwrap(),
        None
    );
}

#[test]
fn bad_plans_are_named() {
    for (plan, needle) in [
        ("explode@3", "explode@3"),
        ("kill@0", "STEP"),
        ("kill@x", "STEP"),
        ("kill@3:a", "RANK"),
    ] {
        let e = Chaos::parse(plan).unwrap_err().to_string();
        assert!(e.contains("--chaos") && e.contains(needle), "{plan}: {e}");
    }
    let c = Chaos::parse("kill@9:5").unwrap();
    assert!(
        one(&c, 0, 0, 0, 9, 2)
            .unwrap_err()
            .to_string()
            .contains("--steps 9")
    );
    let c = Chaos::parse("kill@3:5").unwrap();
    assert!(
        one(&c, 0, 0, 0, 9, 2)
            .unwrap_err()
            .to_string()
            .contains("no rank 5")
    );
    assert!(Fault::parse("kill@random").is_err());
}

#[test]
fn faults_strike_only_their_rank_and_step() {
    let f = Fault {
        kind: FaultKind::Stall,
        step: 3,
        rank: 1,
    };
    let quick = Duration::from_millis(1);
    assert!(f.strike(0, 3, || {}, quick).is_ok());
    assert!(f.strike(1, 2, || {}, quick).is_ok());
    let mut published = false;
    let e = f.strike(1, 3, || published = true, quick).unwrap_err();
    assert!(published && e.to_string().contains("stall@3:1"), "{e}");
}

#[test]
fn slow_faults_parse_round_trip_and_only_delay_their_rank_after_their_step() {
    let c = Chaos::parse("slow@5:1:3").unwrap();
    let f = one(&c, 0, 0, 0, 20, 2).unwrap().unwrap();
    assert_eq!(f.to_string(), "slow@5:1:3");
    assert_eq!(Fault::parse("slow@5:1:3").unwrap(), f);
    assert_eq!(Fault::parse("slow@5:1:2.5").unwrap().kind.factor(), 2.5);
    let r = one(&Chaos::parse("slow@random:1.5").unwrap(), 0, 0, 3, 9, 4);
    assert_eq!(r.unwrap().unwrap().kind, FaultKind::Slow(150));
    let c = Duration::from_millis(100);
    assert_eq!(f.slow_delay(1, 5, c), None);
    assert_eq!(f.slow_delay(1, 6, c), Some(Duration::from_millis(200)));
    assert_eq!(f.slow_delay(0, 6, c), None);
    assert!(f.strike(1, 5, || {}, c).is_ok());
    for (plan, needle) in [
        ("slow@5", "slow@STEP[:RANK]:FACTOR"),
        ("slow@5:1:x", "FACTOR must be a number"),
        ("slow@5:1:1", "above 1"),
        ("slow@5:1:NaN", "above 1"),
        ("slow@5:1:1e9", "at most 100"),
    ] {
        let e = Chaos::parse(plan).unwrap_err().to_string();
        assert!(e.contains(needle), "{plan}: {e}");
    }
}

#[test]
fn later_faults_belong_to_later_generations_and_fall_after_the_last_step_seen() {
    let c = Chaos::parse("kill@random,hang@random:1,slow@2:0:2").unwrap();
    assert_eq!(c.failing(), 2);
    for seed in 0..50 {
        let f0 = one(&c, 0, 0, seed, 10, 2).unwrap().unwrap();
        assert_eq!(f0.kind, FaultKind::Kill);
        assert!((1..10).contains(&f0.step));
        let f1 = one(&c, 1, 6, seed, 10, 2).unwrap().unwrap();
        assert!((7..10).contains(&f1.step) && f1.rank == 1, "{f1}");
        assert_eq!(one(&c, 1, 6, seed, 10, 2).unwrap(), Some(f1));
    }
    assert_eq!(one(&c, 1, 9, 0, 10, 2).unwrap(), None, "no step left");
    assert_eq!(
        one(&c, 2, 9, 0, 10, 2).unwrap().unwrap().to_string(),
        "slow@2:0:2"
    );
    assert_eq!(one(&c, 3, 0, 0, 10, 2).unwrap(), None);
}

#[test]
fn corrupting_an_empty_directory_does_nothing() {
    let d = tempfile::tempdir().unwrap();
    assert_eq!(corrupt_newest(d.path()).unwrap(), None);
    assert_eq!(corrupt_newest(&d.path().join("absent")).unwrap(), None);
}

#[test]
fn slow_faults_ride_with_the_failing_fault_after_them() {
    // Before this, the slow fault took generation 1 whole and kill@5:0 never fired.
    let c = Chaos::parse("kill@2:1,slow@3:0:2,kill@5:0,slow@6:1:3").unwrap();
    assert_eq!(c.failing(), 2);
    let names = |g| {
        let e: Vec<String> = (c.episode(g).iter())
            .map(|f| format!("{}@{:?}", f.kind.name(), f.step))
            .collect();
        e.join(",")
    };
    assert_eq!(names(0), "kill@At(2)");
    assert_eq!(names(1), "slow@At(3),kill@At(5)");
    assert_eq!(names(2), "slow@At(6)");
    assert_eq!(names(3), "");
    let draw = Draw {
        seed: 1,
        steps: 10,
        nproc: 1,
        members: &[0, 1],
        partition_default: Duration::from_secs(6),
    };
    let g1 = c.resolve_in(1, 2, &draw).unwrap();
    assert_eq!(
        Fault::list(&g1),
        "kill@5:0,slow@3:0:2",
        "failing fault first"
    );
    assert_eq!(Fault::parse_list(&Fault::list(&g1)).unwrap(), g1);
}

#[test]
fn partitions_parse_resolve_to_a_node_other_than_0_and_round_trip() {
    let c = Chaos::parse("partition@3:2:8").unwrap();
    assert_eq!(c.failing(), 1);
    let members = [0, 1, 2];
    let draw = Draw {
        seed: 5,
        steps: 10,
        nproc: 2,
        members: &members,
        partition_default: Duration::from_secs(6),
    };
    let f = c.resolve_in(0, 0, &draw).unwrap();
    assert_eq!(Fault::list(&f), "partition@3:2:8");
    assert_eq!(f[0].partition(), Some(Duration::from_secs(8)));
    assert_eq!(Fault::parse("partition@3:2:8").unwrap(), f[0]);
    assert!(
        Fault::parse("partition@3:2").is_err(),
        "a resolved partition has its seconds"
    );
    let r = Chaos::parse("partition@random").unwrap();
    for seed in 0..30 {
        let d = Draw { seed, ..draw };
        let f = r.resolve_in(0, 0, &d).unwrap()[0];
        assert!(f.rank == 1 || f.rank == 2, "{f}");
        assert_eq!(f.partition(), Some(Duration::from_secs(6)), "the default");
    }
    let lone = Draw {
        members: &[0],
        ..draw
    };
    let e = r.resolve_in(0, 0, &lone).unwrap_err().to_string();
    assert!(e.contains("at least 2 nodes"), "{e}");
    let gone = Draw {
        members: &[0, 1],
        ..draw
    };
    let e = c.resolve_in(0, 0, &gone).unwrap_err().to_string();
    assert!(e.contains("node 2 is not in this generation"), "{e}");
    // Every rank of the cut node strikes (the agent hands the fault to that node alone).
    let p = Fault::parse("partition@3:1:1").unwrap();
    assert!(p.strike(7, 2, || {}, Duration::ZERO).is_ok());
    assert!(comm::partition::remaining().is_none(), "not its step");
}
