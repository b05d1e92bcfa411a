//! Text for the character-level model: a vocabulary of characters, a corpus
//! read from a file or generated from a seed, and the data source of random
//! windows of it.

use std::collections::BTreeMap;
use std::io::Read;
use std::ops::Range;
use std::path::Path;

use tch::Tensor;

use crate::Error;
use crate::data::{Batch, DataSource, MAX_GLOBAL_BATCH, check_elements};
use crate::model::dim;
use crate::rng::Rng;

/// Most distinct characters a vocabulary may hold.
pub const MAX_VOCAB: usize = 4096;
/// Largest corpus file read.
pub const MAX_CORPUS_BYTES: u64 = 64 << 20;
/// Longest context window of the data source.
pub const MAX_CONTEXT: usize = 4096;

/// The distinct characters of a text, sorted by code point; a character's
/// token is its index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Vocab {
    chars: Vec<char>,
    index: BTreeMap<char, u16>,
}

impl Vocab {
    /// The vocabulary of `text` (at most [`MAX_VOCAB`] distinct characters).
    pub fn of(text: &str) -> Result<Vocab, Error> {
        let mut index = BTreeMap::new();
        for c in text.chars() {
            if index.len() > MAX_VOCAB {
                break;
            }
            index.insert(c, 0u16);
        }
        if index.len() > MAX_VOCAB {
            return Err(Error::Corpus(format!(
                "more than {MAX_VOCAB} distinct characters"
            )));
        }
        if index.is_empty() {
            return Err(Error::Corpus("the text is empty".into()));
        }
        let chars: Vec<char> = index.keys().copied().collect();
        for (i, c) in chars.iter().enumerate() {
            // i < MAX_VOCAB <= u16::MAX.
            index.insert(*c, i as u16);
        }
        Ok(Vocab { chars, index })
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.chars.len()
    }

    /// Whether the vocabulary is empty (never, for one made by [`of`](Self::of)).
    pub fn is_empty(&self) -> bool {
        self.chars.is_empty()
    }

    /// The characters, in token order.
    pub fn chars(&self) -> &[char] {
        &self.chars
    }

    /// The tokens of `text`; a character outside the vocabulary is an error.
    pub fn encode(&self, text: &str) -> Result<Vec<u16>, Error> {
        text.chars()
            .map(|c| {
                self.index.get(&c).copied().ok_or_else(|| {
                    Error::Corpus(format!("character {c:?} is not in the vocabulary"))
                })
            })
            .collect()
    }

    /// The text of `tokens` (a token outside the vocabulary reads as `?`).
    pub fn decode(&self, tokens: &[i64]) -> String {
        tokens
            .iter()
            .map(|&t| {
                usize::try_from(t)
                    .ok()
                    .and_then(|t| self.chars.get(t))
                    .copied()
                    .unwrap_or('?')
            })
            .collect()
    }
}

/// A text as tokens of its own vocabulary.
#[derive(Debug, Clone)]
pub struct Corpus {
    vocab: Vocab,
    tokens: Vec<u16>,
}

const NAMES: &[&str] = &[
    "alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi",
];
const ADJECTIVES: &[&str] = &[
    "small", "old", "quiet", "red", "bright", "cold", "green", "tall", "heavy", "strange",
];
const NOUNS: &[&str] = &[
    "cat", "dog", "bird", "river", "tree", "house", "garden", "stone", "boat", "lamp", "book",
    "road", "hill", "window", "letter", "song",
];
const VERBS: &[&str] = &[
    "sees", "finds", "likes", "follows", "paints", "carries", "watches", "builds", "hears",
];
const PREPOSITIONS: &[&str] = &["near", "under", "behind", "beside", "across", "above"];

fn pick<'a>(rng: &mut Rng, words: &[&'a str]) -> &'a str {
    words[rng.below(words.len() as u64) as usize]
}

fn noun_phrase(rng: &mut Rng, out: &mut String) {
    out.push_str(if rng.below(3) == 0 { "a " } else { "the " });
    if rng.below(2) == 0 {
        out.push_str(pick(rng, ADJECTIVES));
        out.push(' ');
    }
    out.push_str(pick(rng, NOUNS));
}

impl Corpus {
    /// The corpus of `text`.
    pub fn from_text(text: &str) -> Result<Corpus, Error> {
        let vocab = Vocab::of(text)?;
        let tokens = vocab.encode(text)?;
        Ok(Corpus { vocab, tokens })
    }

    /// The corpus of a UTF-8 file of at most [`MAX_CORPUS_BYTES`].
    pub fn from_file(path: &Path) -> Result<Corpus, Error> {
        let io = |source| Error::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        let mut bytes = Vec::new();
        file.take(MAX_CORPUS_BYTES + 1)
            .read_to_end(&mut bytes)
            .map_err(io)?;
        if bytes.len() as u64 > MAX_CORPUS_BYTES {
            return Err(Error::Corpus(format!(
                "{} is larger than {MAX_CORPUS_BYTES} bytes",
                path.display()
            )));
        }
        let text = String::from_utf8(bytes)
            .map_err(|e| Error::Corpus(format!("{} is not UTF-8: {e}", path.display())))?;
        Corpus::from_text(&text)
    }

    /// A generated English-like text of `chars` characters (lower-case
    /// sentences of a small grammar, capitalised, a paragraph every few
    /// sentences), a pure function of `seed`. Its vocabulary is at most 40
    /// characters.
    pub fn generated(seed: u64, chars: usize) -> Result<Corpus, Error> {
        dim(chars, MAX_CORPUS_BYTES as usize, "generated corpus length")?;
        let mut rng = Rng::keyed(seed, &[0x636f_7270_7573]);
        let mut text = String::with_capacity(chars + 128);
        let mut in_paragraph = 0;
        while text.len() < chars {
            let mut s = String::new();
            if rng.below(3) == 0 {
                s.push_str(pick(&mut rng, NAMES));
            } else {
                noun_phrase(&mut rng, &mut s);
            }
            s.push(' ');
            s.push_str(pick(&mut rng, VERBS));
            s.push(' ');
            noun_phrase(&mut rng, &mut s);
            if rng.below(2) == 0 {
                s.push(' ');
                s.push_str(pick(&mut rng, PREPOSITIONS));
                s.push(' ');
                noun_phrase(&mut rng, &mut s);
            }
            s.push('.');
            // ASCII: the first byte is the first character.
            text.push(s.as_bytes()[0].to_ascii_uppercase() as char);
            text.push_str(&s[1..]);
            in_paragraph += 1;
            if in_paragraph >= 3 + rng.below(4) {
                text.push('\n');
                in_paragraph = 0;
            } else {
                text.push(' ');
            }
        }
        text.truncate(chars);
        Corpus::from_text(&text)
    }

    /// The vocabulary.
    pub fn vocab(&self) -> &Vocab {
        &self.vocab
    }

    /// The text as tokens.
    pub fn tokens(&self) -> &[u16] {
        &self.tokens
    }
}

/// The character data source's parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct CharDataConfig {
    /// Characters per sample (the model's context). Default 64.
    pub context: usize,
    /// Samples per global batch. Default 16.
    pub global_batch: usize,
    /// Seed of the window positions. Default 1.
    pub seed: u64,
}

impl Default for CharDataConfig {
    fn default() -> Self {
        CharDataConfig {
            context: 64,
            global_batch: 16,
            seed: 1,
        }
    }
}

/// Windows of a corpus: sample `j` of step `s` starts at a position drawn
/// from the stream of `(seed, s, j)`, uniform over the corpus; its inputs
/// are `context` tokens and its targets the same window shifted by one
/// (both `i64` `[n, context]`).
#[derive(Debug)]
pub struct CharData {
    config: CharDataConfig,
    corpus: Corpus,
}

impl CharData {
    /// The source over `corpus`, which must be longer than the context.
    pub fn new(corpus: Corpus, config: CharDataConfig) -> Result<CharData, Error> {
        dim(config.context, MAX_CONTEXT, "context")?;
        dim(config.global_batch, MAX_GLOBAL_BATCH, "global batch")?;
        check_elements(config.context, config.global_batch, "char batch")?;
        if corpus.tokens.len() <= config.context {
            return Err(Error::Corpus(format!(
                "{} characters; a sample needs {}",
                corpus.tokens.len(),
                config.context + 1
            )));
        }
        Ok(CharData { config, corpus })
    }

    /// The corpus.
    pub fn corpus(&self) -> &Corpus {
        &self.corpus
    }

    /// The configuration.
    pub fn config(&self) -> &CharDataConfig {
        &self.config
    }
}

impl DataSource for CharData {
    fn global_batch(&self) -> usize {
        self.config.global_batch
    }

    fn seed(&self) -> u64 {
        self.config.seed
    }

    fn samples(&self, step: u64, range: Range<usize>) -> Result<Batch, Error> {
        if range.end > self.config.global_batch || range.start > range.end {
            return Err(Error::Batch(format!(
                "samples {range:?} of a global batch of {}",
                self.config.global_batch
            )));
        }
        let t = self.config.context;
        let starts = (self.corpus.tokens.len() - t) as u64;
        let mut inputs = Vec::with_capacity(range.len() * t);
        let mut targets = Vec::with_capacity(range.len() * t);
        for j in range.clone() {
            let at = Rng::keyed(self.config.seed, &[step, j as u64]).below(starts) as usize;
            let window = &self.corpus.tokens[at..at + t + 1];
            inputs.extend(window[..t].iter().map(|&x| i64::from(x)));
            targets.extend(window[1..].iter().map(|&x| i64::from(x)));
        }
        let shape = [range.len() as i64, t as i64];
        Ok(Batch {
            inputs: Tensor::f_from_slice(&inputs)?.f_reshape(shape)?,
            targets: Tensor::f_from_slice(&targets)?.f_reshape(shape)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::testing::check_rank_batches_concatenate;

    /// A file in the temporary directory, removed on drop.
    struct TempFile(std::path::PathBuf);

    impl TempFile {
        fn new(name: &str, bytes: &[u8]) -> TempFile {
            let path =
                std::env::temp_dir().join(format!("regent-train-{}-{name}", std::process::id()));
            std::fs::write(&path, bytes).unwrap();
            TempFile(path)
        }
    }

    impl Drop for TempFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    #[test]
    fn the_generated_corpus_is_a_function_of_its_seed() {
        let a = Corpus::generated(1, 5000).unwrap();
        assert_eq!(a.tokens().len(), 5000);
        assert_eq!(a.tokens(), Corpus::generated(1, 5000).unwrap().tokens());
        assert_ne!(a.tokens(), Corpus::generated(2, 5000).unwrap().tokens());
        assert!(a.vocab().len() <= 40, "{:?}", a.vocab().chars());
        // Every character of the grammar appears in the default corpus.
        let full = Corpus::generated(1, crate::GENERATED_CORPUS_CHARS).unwrap();
        assert_eq!(full.vocab().len(), 35, "{:?}", full.vocab().chars());
        let text = a.vocab().decode(
            &a.tokens()[..200]
                .iter()
                .map(|&t| i64::from(t))
                .collect::<Vec<_>>(),
        );
        assert!(text.contains(". "), "{text}");
        assert!(text.starts_with(|c: char| c.is_ascii_uppercase()), "{text}");
    }

    #[test]
    fn vocabularies_are_sorted_and_round_trip() {
        let c = Corpus::from_text("héllo wörld").unwrap();
        assert_eq!(
            c.vocab().chars(),
            [' ', 'd', 'h', 'l', 'o', 'r', 'w', 'é', 'ö']
        );
        let tokens: Vec<i64> = c.tokens().iter().map(|&t| i64::from(t)).collect();
        assert_eq!(c.vocab().decode(&tokens), "héllo wörld");
        assert!(c.vocab().encode("x").is_err());
        assert!(Corpus::from_text("").is_err());
        let many: String = (0..=MAX_VOCAB as u32)
            .filter_map(|i| char::from_u32(0x4e00 + i))
            .collect();
        assert!(matches!(Corpus::from_text(&many), Err(Error::Corpus(_))));
    }

    #[test]
    fn files_are_read_with_limits() {
        let ok = TempFile::new("ok.txt", "abc abc abc\n".as_bytes());
        assert_eq!(Corpus::from_file(&ok.0).unwrap().vocab().len(), 5);
        let latin1 = TempFile::new("latin1.txt", &[0x61, 0xe9, 0x62]);
        assert!(matches!(
            Corpus::from_file(&latin1.0),
            Err(Error::Corpus(_))
        ));
        let missing = std::env::temp_dir().join("regent-train-no-such-file");
        assert!(matches!(Corpus::from_file(&missing), Err(Error::Io { .. })));
        let big = TempFile::new("big.txt", b"");
        std::fs::File::options()
            .write(true)
            .open(&big.0)
            .unwrap()
            .set_len(MAX_CORPUS_BYTES + 1)
            .unwrap();
        assert!(matches!(Corpus::from_file(&big.0), Err(Error::Corpus(_))));
    }

    #[test]
    fn windows_are_shifted_targets_and_concatenate() {
        let corpus = Corpus::generated(3, 2000).unwrap();
        let tokens: Vec<u16> = corpus.tokens().to_vec();
        let data = CharData::new(
            corpus,
            CharDataConfig {
                context: 16,
                global_batch: 10,
                seed: 4,
            },
        )
        .unwrap();
        let b = data.batch(5, 0, 1).unwrap();
        assert_eq!(b.inputs.size(), [10, 16]);
        let inputs = Vec::<i64>::try_from(&b.inputs.view([-1])).unwrap();
        let targets = Vec::<i64>::try_from(&b.targets.view([-1])).unwrap();
        for s in 0..10 {
            assert_eq!(
                inputs[s * 16 + 1..(s + 1) * 16],
                targets[s * 16..(s + 1) * 16 - 1]
            );
            let at = tokens.windows(16).position(|w| {
                w.iter()
                    .zip(&inputs[s * 16..])
                    .all(|(&a, &b)| i64::from(a) == b)
            });
            assert!(at.is_some(), "sample {s} is a window of the corpus");
        }
        check_rank_batches_concatenate(&data, 10);
        let tiny = Corpus::from_text("abcd").unwrap();
        assert!(
            CharData::new(
                tiny,
                CharDataConfig {
                    context: 4,
                    ..CharDataConfig::default()
                }
            )
            .is_err()
        );
    }
}
