//! [`Schedule::check`](super::Schedule::check): replays per-stage action lists.
//!
//! Three passes, each with errors that name the stage and action:
//! 1. **Local replay** of each stage on its own: indices and peers in range, dependencies
//!    satisfied by earlier actions of the same stage (a forward needs its input received, a
//!    backward its own forward and its output gradient, a send its producing compute), nothing
//!    done twice, the optimizer step last and after every backward, nothing missing at the end.
//! 2. **Link order**: for each ordered pair of stages, the sends of one equal the receives of
//!    the other, in order (point-to-point messages are matched in call order).
//! 3. **Rendezvous replay** of all stages together: a send completes only together with its
//!    receive (zero buffering). If no stage can move and some are unfinished, that is a
//!    deadlock, reported with every blocked stage's action. Passing with zero buffering implies
//!    passing with any: buffering only lets sends complete earlier.
//!
//! Cross-stage dependencies follow from 1 and 3 together: the consumer receives before it
//! computes, the producer sends after it computes, and the receive completes with the send.
use super::schedule::{Action, MAX_CHUNK_MICROBATCHES, invalid};
use super::{Result, ScheduleError};

/// A message on a link, named by its kind, micro-batch and producing model chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Msg {
    Activation { mb: usize, producer: usize },
    Grad { mb: usize, producer: usize },
}

impl std::fmt::Display for Msg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Msg::Activation { mb, producer } => {
                write!(f, "activation of mb {mb} from model chunk {producer}")
            }
            Msg::Grad { mb, producer } => {
                write!(f, "gradient of mb {mb} from model chunk {producer}")
            }
        }
    }
}

/// Per-stage flags, indexed `mb * v + chunk`.
struct Local {
    fwd: Vec<bool>,
    bwd: Vec<bool>,
    act_in: Vec<bool>,
    grad_in: Vec<bool>,
    act_out: Vec<bool>,
    grad_out: Vec<bool>,
}

pub(super) fn check(p: usize, m: usize, v: usize, per_stage: &[Vec<Action>]) -> Result<()> {
    if p == 0 || per_stage.len() != p {
        return Err(invalid(
            "pipeline_stages",
            per_stage.len(),
            "a schedule needs one action list per stage and at least one stage",
        ));
    }
    if m == 0 {
        return Err(invalid("microbatches", m, "m >= 1"));
    }
    if v == 0 {
        return Err(invalid("virtual_stages", v, "v >= 1"));
    }
    let total = p.checked_mul(v).and_then(|pv| pv.checked_mul(m));
    if total.is_none_or(|t| t > MAX_CHUNK_MICROBATCHES) {
        return Err(ScheduleError::Invalid {
            field: "microbatches",
            value: m.to_string(),
            reason: format!(
                "pipeline_stages * virtual_stages * microbatches = {p} * {v} * {m} exceeds \
                 {MAX_CHUNK_MICROBATCHES}"
            ),
        });
    }
    for (s, list) in per_stage.iter().enumerate() {
        replay_stage(p, m, v, s, list)?;
    }
    check_links(p, per_stage)?;
    rendezvous(p, per_stage)
}

/// Pass 1 for stage `s`.
fn replay_stage(p: usize, m: usize, v: usize, s: usize, list: &[Action]) -> Result<()> {
    let n = m * v;
    let last = p * v - 1;
    let mut st = Local {
        fwd: vec![false; n],
        bwd: vec![false; n],
        act_in: vec![false; n],
        grad_in: vec![false; n],
        act_out: vec![false; n],
        grad_out: vec![false; n],
    };
    let mut stepped = false;
    for (index, &action) in list.iter().enumerate() {
        let err = |reason: String| ScheduleError::Action {
            stage: s,
            index,
            action,
            reason,
        };
        if stepped {
            return Err(err("action after the optimizer step".into()));
        }
        let (mb, chunk) = match action {
            Action::OptimizerStep => {
                if let Some(i) = st.bwd.iter().position(|&d| !d) {
                    return Err(err(format!(
                        "optimizer step before the backward of mb {} chunk {} (one update \
                         after all {m} micro-batches, Algorithm 1 step 8)",
                        i / v,
                        i % v
                    )));
                }
                stepped = true;
                continue;
            }
            Action::Forward { mb, chunk }
            | Action::Backward { mb, chunk }
            | Action::SendActivation { mb, chunk, .. }
            | Action::RecvActivation { mb, chunk, .. }
            | Action::SendGrad { mb, chunk, .. }
            | Action::RecvGrad { mb, chunk, .. } => (mb, chunk),
        };
        if mb >= m {
            return Err(err(format!("micro-batch {mb} out of range (m = {m})")));
        }
        if chunk >= v {
            return Err(err(format!("chunk {chunk} out of range (v = {v})")));
        }
        let i = mb * v + chunk;
        let k = chunk * p + s;
        // The neighbours of model chunk k and where they live.
        let prev = k.checked_sub(1).map(|j| (j % p, j / p));
        let next = (k < last).then(|| ((k + 1) % p, (k + 1) / p));
        match action {
            Action::Forward { .. } => {
                if st.fwd[i] {
                    return Err(err("forwarded twice".into()));
                }
                let missing = match prev {
                    Some((ps, pc)) if ps == s && !st.fwd[mb * v + pc] => Some(format!(
                        "forward before its input: chunk {pc}'s forward of mb {mb} has not run"
                    )),
                    Some((ps, _)) if ps != s && !st.act_in[i] => Some(format!(
                        "forward before its input activation is received from stage {ps}"
                    )),
                    _ => None,
                };
                if let Some(reason) = missing {
                    return Err(err(reason));
                }
                st.fwd[i] = true;
            }
            Action::Backward { .. } => {
                if st.bwd[i] {
                    return Err(err("backwarded twice".into()));
                }
                if !st.fwd[i] {
                    return Err(err("backward before its forward".into()));
                }
                let missing = match next {
                    Some((ns, nc)) if ns == s && !st.bwd[mb * v + nc] => Some(format!(
                        "backward before its output gradient: chunk {nc}'s backward of mb {mb} \
                         has not run"
                    )),
                    Some((ns, _)) if ns != s && !st.grad_in[i] => Some(format!(
                        "backward before its output gradient is received from stage {ns}"
                    )),
                    _ => None,
                };
                if let Some(reason) = missing {
                    return Err(err(reason));
                }
                st.bwd[i] = true;
            }
            Action::SendActivation { to, .. } => {
                match next {
                    Some((ns, _)) if ns == to && ns != s => {}
                    Some((ns, _)) if ns != s => {
                        return Err(err(format!("model chunk {} lives on stage {ns}", k + 1)));
                    }
                    _ => {
                        return Err(err(format!(
                            "model chunk {k} has no successor on another stage"
                        )));
                    }
                }
                if !st.fwd[i] {
                    return Err(err("activation sent before its forward".into()));
                }
                if st.act_out[i] {
                    return Err(err("activation sent twice".into()));
                }
                st.act_out[i] = true;
            }
            Action::RecvActivation { from, .. } => {
                match prev {
                    Some((ps, _)) if ps == from && ps != s => {}
                    Some((ps, _)) if ps != s => {
                        return Err(err(format!("model chunk {} lives on stage {ps}", k - 1)));
                    }
                    _ => {
                        return Err(err(format!(
                            "model chunk {k} has no predecessor on another stage"
                        )));
                    }
                }
                if st.act_in[i] {
                    return Err(err("activation received twice".into()));
                }
                st.act_in[i] = true;
            }
            Action::SendGrad { to, .. } => {
                match prev {
                    Some((ps, _)) if ps == to && ps != s => {}
                    Some((ps, _)) if ps != s => {
                        return Err(err(format!("model chunk {} lives on stage {ps}", k - 1)));
                    }
                    _ => {
                        return Err(err(format!(
                            "model chunk {k} has no predecessor on another stage"
                        )));
                    }
                }
                if !st.bwd[i] {
                    return Err(err("gradient sent before its backward".into()));
                }
                if st.grad_out[i] {
                    return Err(err("gradient sent twice".into()));
                }
                st.grad_out[i] = true;
            }
            Action::RecvGrad { from, .. } => {
                match next {
                    Some((ns, _)) if ns == from && ns != s => {}
                    Some((ns, _)) if ns != s => {
                        return Err(err(format!("model chunk {} lives on stage {ns}", k + 1)));
                    }
                    _ => {
                        return Err(err(format!(
                            "model chunk {k} has no successor on another stage"
                        )));
                    }
                }
                if st.grad_in[i] {
                    return Err(err("gradient received twice".into()));
                }
                st.grad_in[i] = true;
            }
            Action::OptimizerStep => {}
        }
    }
    // Completeness: every chunk forwarded and backwarded, every cross-stage output sent.
    for i in 0..n {
        let (mb, chunk) = (i / v, i % v);
        let k = chunk * p + s;
        let missing = if !st.fwd[i] {
            Some("never forwarded")
        } else if !st.bwd[i] {
            Some("never backwarded")
        } else if k < p * v - 1 && (k + 1) % p != s && !st.act_out[i] {
            Some("activation never sent")
        } else if k > 0 && (k - 1) % p != s && !st.grad_out[i] {
            Some("input gradient never sent")
        } else {
            None
        };
        if let Some(what) = missing {
            return Err(ScheduleError::Incomplete {
                stage: s,
                reason: format!("mb {mb} chunk {chunk}: {what}"),
            });
        }
    }
    if !stepped {
        return Err(ScheduleError::Incomplete {
            stage: s,
            reason: "no optimizer step".into(),
        });
    }
    Ok(())
}

/// The message a communication action on stage `s` sends or receives: (peer, is_send, msg).
fn msg_of(p: usize, s: usize, a: Action) -> Option<(usize, bool, Msg)> {
    match a {
        Action::SendActivation { mb, chunk, to } => Some((
            to,
            true,
            Msg::Activation {
                mb,
                producer: chunk * p + s,
            },
        )),
        Action::RecvActivation { mb, chunk, from } => Some((
            from,
            false,
            Msg::Activation {
                mb,
                producer: (chunk * p + s).saturating_sub(1),
            },
        )),
        Action::SendGrad { mb, chunk, to } => Some((
            to,
            true,
            Msg::Grad {
                mb,
                producer: chunk * p + s,
            },
        )),
        Action::RecvGrad { mb, chunk, from } => Some((
            from,
            false,
            Msg::Grad {
                mb,
                producer: chunk * p + s + 1,
            },
        )),
        _ => None,
    }
}

/// Pass 2: on each ordered link, the sender's sequence equals the receiver's.
fn check_links(p: usize, per_stage: &[Vec<Action>]) -> Result<()> {
    // sent[a][b] / received[b][a]: messages from a to b in list order.
    let mut sent = vec![vec![Vec::new(); p]; p];
    let mut received = vec![vec![Vec::new(); p]; p];
    for (s, list) in per_stage.iter().enumerate() {
        for &a in list {
            if let Some((peer, is_send, msg)) = msg_of(p, s, a) {
                if is_send {
                    sent[s][peer].push(msg);
                } else {
                    received[peer][s].push(msg);
                }
            }
        }
    }
    for from in 0..p {
        for to in 0..p {
            let (tx, rx) = (&sent[from][to], &received[from][to]);
            let n = tx.len().max(rx.len());
            for position in 0..n {
                let (a, b) = (tx.get(position), rx.get(position));
                if a != b {
                    let show = |m: Option<&Msg>| m.map_or("none".to_string(), |m| m.to_string());
                    return Err(ScheduleError::Mismatch {
                        from,
                        to,
                        position,
                        sent: show(a),
                        received: show(b),
                    });
                }
            }
        }
    }
    Ok(())
}

/// Pass 3: all stages together, a send and its receive completing as one step.
fn rendezvous(p: usize, per_stage: &[Vec<Action>]) -> Result<()> {
    let mut pc = vec![0usize; p];
    loop {
        let mut progress = false;
        for s in 0..p {
            while let Some(&a) = per_stage[s].get(pc[s]) {
                match msg_of(p, s, a) {
                    None => pc[s] += 1,
                    Some((peer, is_send, msg)) => {
                        let matched = per_stage[peer].get(pc[peer]).is_some_and(|&b| {
                            msg_of(p, peer, b) == Some((s, !is_send, msg)) && peer != s
                        });
                        if !matched {
                            break;
                        }
                        pc[s] += 1;
                        pc[peer] += 1;
                    }
                }
                progress = true;
            }
        }
        if (0..p).all(|s| pc[s] == per_stage[s].len()) {
            return Ok(());
        }
        if !progress {
            let detail = (0..p)
                .filter_map(|s| {
                    per_stage[s]
                        .get(pc[s])
                        .map(|a| format!("stage {s} blocked at action {} ({a})", pc[s]))
                })
                .collect::<Vec<_>>()
                .join("; ");
            return Err(ScheduleError::Deadlock { detail });
        }
    }
}
