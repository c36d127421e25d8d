//! English-like text from a small embedded grammar.

use rand_chacha::ChaCha8Rng;

use crate::rng::{below, stream_rng};

const DETERMINERS: &[&str] = &["the", "a", "every", "one", "that", "my", "our", "this"];
const ADJECTIVES: &[&str] = &[
    "small", "old", "red", "quiet", "bright", "clever", "lazy", "green", "tall", "happy", "angry",
    "gentle",
];
const NOUNS: &[&str] = &[
    "cat", "dog", "bird", "child", "farmer", "teacher", "river", "garden", "house", "ship", "king",
    "tree", "book", "horse", "fox", "apple", "owl", "island",
];
/// (third person singular, base form) pairs.
const VERBS: &[(&str, &str)] = &[
    ("sees", "see"),
    ("finds", "find"),
    ("likes", "like"),
    ("follows", "follow"),
    ("watches", "watch"),
    ("carries", "carry"),
    ("paints", "paint"),
    ("feeds", "feed"),
    ("chases", "chase"),
    ("helps", "help"),
    ("builds", "build"),
    ("reads", "read"),
];
const ADVERBS: &[&str] = &["slowly", "quietly", "often", "never", "always", "happily"];
const PREPOSITIONS: &[&str] = &["near", "under", "behind", "beside", "with", "across"];
const CONJUNCTIONS: &[&str] = &["and", "but", "while", "because"];

/// A seeded stream of English-like sentences from a small embedded grammar.
///
/// ```text
/// sentence  := clause [", " conj " " clause] ("." | "!")  |  "Does " np " " verb " " np "?"
/// clause    := np [" " adverb] " " verb " " np [" " prep " " np]
/// np        := det [" " adj] " " noun        ("a" becomes "an" before a vowel)
/// ```
///
/// About eighty word forms, all ASCII, singular subjects with agreeing verbs. Sentences are separated
/// by a space or, one time in five, a newline.
#[derive(Debug, Clone)]
pub struct TextCorpus {
    rng: ChaCha8Rng,
    /// Generated text not yet returned, carried into the next `generate` call.
    pending: String,
}

impl TextCorpus {
    /// Starts the stream for `seed`.
    pub fn new(seed: u64) -> Self {
        TextCorpus {
            rng: stream_rng(seed),
            pending: String::new(),
        }
    }

    /// Returns the next `n_bytes` bytes of the stream (ASCII, so exactly `n_bytes` characters).
    /// The cut may fall mid-sentence; the next call continues where this one stopped.
    pub fn generate(&mut self, n_bytes: usize) -> String {
        while self.pending.len() < n_bytes {
            self.push_sentence();
        }
        // All words and punctuation are ASCII, so every index is a char boundary.
        let rest = self.pending.split_off(n_bytes);
        std::mem::replace(&mut self.pending, rest)
    }

    /// Appends one sentence and its separator to `pending`.
    fn push_sentence(&mut self) {
        let start = self.pending.len();
        if self.chance(1, 8) {
            self.pending.push_str("does ");
            self.push_np();
            let verb = self.pick_verb().1;
            self.push_words(&[" ", verb, " "]);
            self.push_np();
            self.pending.push('?');
        } else {
            self.push_clause();
            if self.chance(1, 3) {
                let conj = self.pick(CONJUNCTIONS);
                self.push_words(&[", ", conj, " "]);
                self.push_clause();
            }
            let end = if self.chance(1, 10) { '!' } else { '.' };
            self.pending.push(end);
        }
        self.pending[start..start + 1].make_ascii_uppercase();
        let sep = if self.chance(1, 5) { '\n' } else { ' ' };
        self.pending.push(sep);
    }

    fn push_clause(&mut self) {
        self.push_np();
        if self.chance(1, 4) {
            let adverb = self.pick(ADVERBS);
            self.push_words(&[" ", adverb]);
        }
        let verb = self.pick_verb().0;
        self.push_words(&[" ", verb, " "]);
        self.push_np();
        if self.chance(1, 3) {
            let prep = self.pick(PREPOSITIONS);
            self.push_words(&[" ", prep, " "]);
            self.push_np();
        }
    }

    fn push_np(&mut self) {
        let det = self.pick(DETERMINERS);
        let adj = self.chance(1, 2).then(|| self.pick(ADJECTIVES));
        let noun = self.pick(NOUNS);
        let next = adj.unwrap_or(noun);
        let det = if det == "a" && next.starts_with(['a', 'e', 'i', 'o', 'u']) {
            "an"
        } else {
            det
        };
        self.pending.push_str(det);
        if let Some(adj) = adj {
            self.push_words(&[" ", adj]);
        }
        self.push_words(&[" ", noun]);
    }

    fn push_words(&mut self, words: &[&str]) {
        words.iter().for_each(|w| self.pending.push_str(w));
    }

    fn pick(&mut self, words: &[&'static str]) -> &'static str {
        words[below(&mut self.rng, words.len() as u64) as usize]
    }

    fn pick_verb(&mut self) -> (&'static str, &'static str) {
        VERBS[below(&mut self.rng, VERBS.len() as u64) as usize]
    }

    fn chance(&mut self, num: u64, den: u64) -> bool {
        below(&mut self.rng, den) < num
    }
}
