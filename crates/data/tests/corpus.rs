//! Synthetic corpora: determinism, entropy rate and argument checks.

use std::collections::HashMap;

use data::{DataError, MarkovCorpus, TextCorpus};

fn stream(corpus: &mut MarkovCorpus, n: usize) -> Vec<u32> {
    let mut out = vec![0; n];
    corpus.fill(&mut out);
    out
}

#[test]
fn markov_same_seed_same_stream_different_seed_different() {
    let a = stream(&mut MarkovCorpus::new(100, 42, 4).unwrap(), 5000);
    let b = stream(&mut MarkovCorpus::new(100, 42, 4).unwrap(), 5000);
    let c = stream(&mut MarkovCorpus::new(100, 43, 4).unwrap(), 5000);
    assert_eq!(a, b);
    assert_ne!(a, c);
    assert!(a.iter().all(|&id| id < 100));
}

#[test]
fn markov_fill_continues_the_stream() {
    let whole = stream(&mut MarkovCorpus::new(50, 1, 3).unwrap(), 1000);
    let mut corpus = MarkovCorpus::new(50, 1, 3).unwrap();
    let mut parts = stream(&mut corpus, 300);
    parts.extend(stream(&mut corpus, 700));
    assert_eq!(whole, parts);
}

#[test]
fn markov_reseed_keeps_chain_changes_stream() {
    let mut a = MarkovCorpus::new(80, 5, 3).unwrap();
    let mut b = a.clone();
    b.reseed(99);
    let (sa, sb) = (stream(&mut a, 2000), stream(&mut b, 2000));
    assert_ne!(sa, sb);
    assert_eq!(a.entropy_rate_nats(), b.entropy_rate_nats());
    // Every transition in the reseeded stream is an edge of the shared chain.
    for w in sb.windows(2) {
        let (succ, _) = a.successors(w[0]).unwrap();
        assert!(succ.contains(&w[1]), "{} -> {} is not an edge", w[0], w[1]);
    }
}

#[test]
fn markov_rows_are_distributions() {
    let corpus = MarkovCorpus::new(300, 3, 6).unwrap();
    for token in 0..300 {
        let (succ, prob) = corpus.successors(token).unwrap();
        assert_eq!((succ.len(), prob.len()), (6, 6));
        let mut sorted = succ.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), 6, "successors of {token} repeat: {succ:?}");
        assert!((prob.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        assert!(prob.iter().all(|&p| p > 0.0));
    }
    assert!(corpus.successors(300).is_none());
}

#[test]
fn entropy_rate_bounds() {
    for (vocab, branching) in [(2, 2), (10, 3), (257, 4), (1000, 8), (64, 64)] {
        let corpus = MarkovCorpus::new(vocab, 11, branching).unwrap();
        let h = corpus.entropy_rate_nats();
        assert!(h > 0.0, "vocab {vocab} branching {branching}: {h}");
        assert!(
            h <= (branching as f64).ln() + 1e-12,
            "vocab {vocab} branching {branching}: {h}"
        );
        assert!(h < corpus.uniform_nats());
    }
    let deterministic = MarkovCorpus::new(500, 11, 1).unwrap();
    assert_eq!(deterministic.entropy_rate_nats(), 0.0);
    assert!((deterministic.uniform_nats() - 500f64.ln()).abs() < 1e-12);
}

#[test]
fn branching_one_is_a_single_cycle_over_the_vocabulary() {
    let mut corpus = MarkovCorpus::new(37, 2, 1).unwrap();
    let s = stream(&mut corpus, 37 * 3);
    let mut first: Vec<u32> = s[..37].to_vec();
    assert_eq!(&s[..37], &s[37..74]);
    first.sort_unstable();
    assert_eq!(first, (0..37).collect::<Vec<u32>>());
}

/// Plug-in estimate of H(X_{t+1} | X_t) from bigram counts, in nats.
fn empirical_conditional_entropy(s: &[u32]) -> f64 {
    let mut pairs: HashMap<(u32, u32), f64> = HashMap::new();
    let mut firsts: HashMap<u32, f64> = HashMap::new();
    for w in s.windows(2) {
        *pairs.entry((w[0], w[1])).or_default() += 1.0;
        *firsts.entry(w[0]).or_default() += 1.0;
    }
    let n = (s.len() - 1) as f64;
    pairs
        .iter()
        .map(|(&(a, _), &c)| -(c / n) * (c / firsts[&a]).ln())
        .sum()
}

#[test]
fn empirical_entropy_matches_entropy_rate() {
    for (vocab, branching, seed) in [(64, 4, 1), (200, 8, 2), (20, 2, 3)] {
        let mut corpus = MarkovCorpus::new(vocab, seed, branching).unwrap();
        let exact = corpus.entropy_rate_nats();
        let empirical = empirical_conditional_entropy(&stream(&mut corpus, 400_000));
        let rel = (empirical - exact).abs() / exact;
        assert!(
            rel < 0.02,
            "vocab {vocab} branching {branching}: exact {exact} empirical {empirical}"
        );
    }
}

#[test]
fn markov_argument_errors_name_the_field() {
    let field = |r: Result<MarkovCorpus, DataError>| match r {
        Err(DataError::InvalidArgument { field, .. }) => field,
        other => panic!("expected InvalidArgument, got {other:?}"),
    };
    assert_eq!(field(MarkovCorpus::new(1, 0, 1)), "vocab");
    assert_eq!(field(MarkovCorpus::new(0, 0, 1)), "vocab");
    assert_eq!(field(MarkovCorpus::new(10, 0, 0)), "branching");
    assert_eq!(field(MarkovCorpus::new(10, 0, 11)), "branching");
    assert_eq!(field(MarkovCorpus::new(1 << 20, 0, 1 << 10)), "branching");
    assert_eq!(
        field(MarkovCorpus::new(usize::MAX, 0, usize::MAX)),
        "branching"
    );
    let msg = MarkovCorpus::new(10, 0, 11).unwrap_err().to_string();
    assert!(
        msg.contains("branching") && msg.contains("11") && msg.contains("10"),
        "{msg}"
    );
}

#[test]
fn text_corpus_is_deterministic_and_continues() {
    let a = TextCorpus::new(7).generate(4000);
    let mut b = TextCorpus::new(7);
    let joined = b.generate(1234) + &b.generate(2766);
    assert_eq!(a.len(), 4000);
    assert_eq!(a, joined);
    assert_ne!(a, TextCorpus::new(8).generate(4000));
}

#[test]
fn text_corpus_looks_like_english() {
    let text = TextCorpus::new(1).generate(20_000);
    assert!(text.is_ascii());
    assert!(text.contains(". ") || text.contains(".\n"));
    assert!(text.contains('?') && text.contains(',') && text.contains('\n'));
    assert!(text.contains("The ") && text.contains(" the "));
    assert!(!text.contains(" a old") && !text.contains(" a apple"));
    assert!(!text.contains("  "));
    // Sentences start with a capital letter.
    for sentence in text.split(['.', '!', '?']).skip(1) {
        if let Some(c) = sentence.trim_start().chars().next() {
            assert!(c.is_ascii_uppercase(), "{sentence:?}");
        }
    }
    let words: std::collections::HashSet<&str> = text
        .split(|c: char| !c.is_ascii_alphabetic())
        .filter(|w| !w.is_empty())
        .collect();
    assert!(
        words.len() > 40 && words.len() < 100,
        "{} distinct words",
        words.len()
    );
}
