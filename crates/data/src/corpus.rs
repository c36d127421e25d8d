//! Built-in synthetic corpora, so training runs with no download.
//!
//! - [`MarkovCorpus`]: token ids from a seeded first-order Markov chain whose exact entropy rate
//!   is known, so a run can be judged against the best achievable loss.
//! - [`TextCorpus`]: English-like sentences from a small embedded grammar, so the byte tokenizer
//!   and `flotilla generate` show recognisable text.
//!
//! Both are deterministic functions of their seed (ChaCha8).

mod grammar;
mod markov;

pub use grammar::TextCorpus;
pub use markov::{MAX_TRANSITIONS, MarkovCorpus};
