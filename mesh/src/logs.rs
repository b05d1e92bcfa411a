//! Procs' output at the controller: every line a proc writes to its stdout
//! or stderr (its `tracing` events among them) reaches the controller as a
//! [`LogLine`], and the controller's [`LogSink`] prints it with a prefix
//! that says where it came from, torchrun style:
//!
//! ```text
//! [train r2 g3] loss 1.23        a line written while member 2 of mesh
//!                                 `train`, generation 3, ran (its tracing)
//! [p0 r1] listening              a proc's raw output (proc mesh p0, rank 1)
//! [train r0-3 g1] epoch done     the same line from ranks 0..=3, folded
//! ```
//!
//! - Host agents pipe each proc's stdout and stderr and split them into
//!   lines of at most [`MAX_LINE_BYTES`] ([`LineSplitter`]; a partial last
//!   line is kept at EOF). Readers never block the proc: when the
//!   controller is slow, lines are dropped and counted, and a
//!   `regent: N lines dropped` line says so.
//! - Each proc's last [`MAX_TAIL_LINES`] lines (the partial one included)
//!   come with its exit: `FailureCause::ProcExited::last_lines`.
//! - A proc's `tracing` output goes to its stderr through [`ProcStderr`],
//!   which prefixes every event written on a member's thread with the
//!   member's [`MemberTag`] (after [`TAG_MARK`], so that a user's line
//!   that looks like a tag is not taken for one); the sink reads that tag
//!   back ([`MemberTag::parse`]). Raw stdout (`println!`) cannot be told
//!   apart by member, so it carries its proc's identity.
//! - [`LogMode`]: fold repeated identical lines across ranks (Monarch-style,
//!   within [`LogConfig::fold_window`]), print every line, print JSON lines,
//!   or print nothing. In every mode [`LogSink::subscribe`] hands out what
//!   the sink emits ([`LogRecord`]s).

use std::cell::RefCell;
use std::collections::{BTreeSet, VecDeque};
use std::fmt;
use std::future::Future;
use std::io::Write as _;
use std::num::NonZeroUsize;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use regent_net::ProcId;
use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize};
use tokio::sync::{broadcast, mpsc};
use tokio::time::Instant;

/// The longest line a proc's output is cut into (bytes); a longer line
/// arrives as several.
pub const MAX_LINE_BYTES: usize = 4096;
/// How many of a proc's last lines come with its exit.
pub const MAX_TAIL_LINES: usize = 32;
/// How many bytes of a proc's last lines come with its exit (the failure
/// travels to every survivor's proc and into escalations): the oldest
/// lines go first, the last one always stays.
pub const MAX_TAIL_BYTES: usize = 8 * 1024;
/// The most lines one wire batch (the host wire's `ProcLogs`) carries.
pub const MAX_LOG_BATCH: usize = 256;

const DROPPED_SUFFIX: &str = " lines dropped (the controller was slow)";

/// Which of a proc's streams a line came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum LogStream {
    /// Its stdout.
    Stdout,
    /// Its stderr (its `tracing` output too).
    Stderr,
}

impl LogStream {
    /// `stdout` or `stderr`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stdout => "stdout",
            Self::Stderr => "stderr",
        }
    }
}

/// One line of a proc's output, without its newline.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogLine {
    /// The proc that wrote it.
    pub proc: ProcId,
    /// Which stream.
    pub stream: LogStream,
    /// The text (at most [`MAX_LINE_BYTES`]; bytes that are not UTF-8 are
    /// replaced).
    #[serde(deserialize_with = "bounded_text")]
    pub text: String,
}

impl LogLine {
    /// The line that says `n` lines of `proc` were dropped.
    pub fn dropped(proc: ProcId, stream: LogStream, n: u64) -> Self {
        Self {
            proc,
            stream,
            text: format!("regent: {n}{DROPPED_SUFFIX}"),
        }
    }

    /// How many lines this line stands for when it is dropped: `n` for a
    /// [`Self::dropped`] line (so a count dropped further on is kept), 1
    /// for any other.
    pub fn weight(&self) -> u64 {
        self.text
            .strip_prefix("regent: ")
            .and_then(|t| t.strip_suffix(DROPPED_SUFFIX))
            .and_then(digits)
            .unwrap_or(1)
    }
}

impl fmt::Display for LogLine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[{}] {}", self.proc, self.text)
    }
}

fn bounded_text<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    let text = String::deserialize(d)?;
    if text.len() > MAX_LINE_BYTES {
        return Err(D::Error::custom(format!(
            "a log line of {} bytes (at most {MAX_LINE_BYTES})",
            text.len()
        )));
    }
    Ok(text)
}

/// Decodes a proc's last lines: at most [`MAX_TAIL_LINES`], of at most
/// [`MAX_TAIL_BYTES`] in all (or one line).
pub(crate) fn bounded_tail<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<LogLine>, D::Error> {
    let lines = bounded_lines(d, MAX_TAIL_LINES)?;
    let bytes: usize = lines.iter().map(|l| l.text.len()).sum();
    if lines.len() > 1 && bytes > MAX_TAIL_BYTES {
        return Err(D::Error::custom(format!(
            "last lines of {bytes} bytes (at most {MAX_TAIL_BYTES})"
        )));
    }
    Ok(lines)
}

/// Decodes a batch of lines: at most [`MAX_LOG_BATCH`].
pub(crate) fn bounded_batch<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<LogLine>, D::Error> {
    bounded_lines(d, MAX_LOG_BATCH)
}

fn bounded_lines<'de, D: Deserializer<'de>>(d: D, max: usize) -> Result<Vec<LogLine>, D::Error> {
    struct Lines(usize);
    impl<'de> serde::de::Visitor<'de> for Lines {
        type Value = Vec<LogLine>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            write!(f, "at most {} log lines", self.0)
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(
            self,
            mut seq: A,
        ) -> Result<Self::Value, A::Error> {
            let mut lines = Vec::new();
            while let Some(line) = seq.next_element::<LogLine>()? {
                if lines.len() == self.0 {
                    return Err(A::Error::custom(format!("more than {} log lines", self.0)));
                }
                lines.push(line);
            }
            Ok(lines)
        }
    }
    d.deserialize_seq(Lines(max))
}

/// Splits a stream of bytes (a proc's pipe) into lines of at most
/// [`MAX_LINE_BYTES`]: `\n` ends a line (a `\r` before it is dropped), a
/// longer line is cut, and [`Self::finish`] gives the partial last line.
#[derive(Debug, Default)]
pub struct LineSplitter {
    partial: Vec<u8>,
}

impl LineSplitter {
    /// Feeds bytes; returns the lines they complete.
    pub fn push(&mut self, mut bytes: &[u8]) -> Vec<String> {
        let mut lines = Vec::new();
        while !bytes.is_empty() {
            let room = MAX_LINE_BYTES - self.partial.len();
            let window = &bytes[..bytes.len().min(room)];
            match window.iter().position(|&b| b == b'\n') {
                Some(i) => {
                    self.partial.extend_from_slice(&window[..i]);
                    lines.push(self.take());
                    bytes = &bytes[i + 1..];
                }
                None => {
                    self.partial.extend_from_slice(window);
                    bytes = &bytes[window.len()..];
                    if self.partial.len() == MAX_LINE_BYTES {
                        lines.push(self.take());
                    }
                }
            }
        }
        lines
    }

    /// The partial last line, if any (at EOF).
    pub fn finish(&mut self) -> Option<String> {
        (!self.partial.is_empty()).then(|| self.take())
    }

    fn take(&mut self) -> String {
        let mut bytes = std::mem::take(&mut self.partial);
        if bytes.last() == Some(&b'\r') {
            bytes.pop();
        }
        let text = String::from_utf8_lossy(&bytes).into_owned();
        // Replacement characters can make a cut line longer than it was.
        truncate_to(text, MAX_LINE_BYTES)
    }
}

/// `text` cut to at most `max` bytes, on a character boundary.
fn truncate_to(mut text: String, max: usize) -> String {
    if text.len() > max {
        let mut end = max;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
    text
}

/// A proc's last lines (both streams, in arrival order), bounded.
#[derive(Debug, Default)]
pub(crate) struct Tail {
    lines: VecDeque<LogLine>,
    bytes: usize,
}

impl Tail {
    pub(crate) fn push(&mut self, line: LogLine) {
        self.bytes += line.text.len();
        self.lines.push_back(line);
        while self.lines.len() > MAX_TAIL_LINES
            || (self.lines.len() > 1 && self.bytes > MAX_TAIL_BYTES)
        {
            if let Some(old) = self.lines.pop_front() {
                self.bytes -= old.text.len();
            }
        }
    }

    pub(crate) fn take(&mut self) -> Vec<LogLine> {
        self.bytes = 0;
        self.lines.drain(..).collect()
    }
}

/// The character that starts a member's tag on a proc's stderr (ASCII's
/// record separator, which no one prints by accident): a user's line that
/// happens to look like `[mesh r1 g2] ...` is not read as that member's.
pub const TAG_MARK: char = '\u{1e}';

/// Which member a line was written for: the prefix `[mesh rRANK gGEN]`
/// (after [`TAG_MARK`] on the wire).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MemberTag {
    /// The mesh's name.
    pub mesh: String,
    /// The member's rank.
    pub rank: u32,
    /// The life's generation.
    pub generation: u64,
}

impl fmt::Display for MemberTag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[{} r{} g{}]", self.mesh, self.rank, self.generation)
    }
}

impl MemberTag {
    /// Reads a tag at the start of `text` (`TAG_MARK` then `[mesh rN gN]
    /// rest`): the tag and the rest, or `None` if `text` does not start
    /// with one. A mesh name with whitespace or `]` is never tagged.
    pub fn parse(text: &str) -> Option<(Self, &str)> {
        let inner = text.strip_prefix(TAG_MARK)?.strip_prefix('[')?;
        let (inside, rest) = inner.split_once("] ")?;
        let mut parts = inside.split(' ');
        let (mesh, rank, generation) = (parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() || mesh.is_empty() {
            return None;
        }
        let rank = digits(rank.strip_prefix('r')?)?;
        let generation = digits(generation.strip_prefix('g')?)?;
        Some((
            Self {
                mesh: mesh.to_owned(),
                rank: u32::try_from(rank).ok()?,
                generation,
            },
            rest,
        ))
    }

    fn taggable(mesh: &str) -> bool {
        !mesh.is_empty() && !mesh.contains(|c: char| c.is_whitespace() || c == ']')
    }
}

fn digits(s: &str) -> Option<u64> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

thread_local! {
    /// The prefix of the member whose code runs on this thread now.
    static MEMBER: RefCell<Option<Arc<str>>> = const { RefCell::new(None) };
}

/// The prefix [`ProcStderr`] writes before `tag`'s lines (`None`: a mesh
/// name that cannot be read back as a tag).
pub(crate) fn member_prefix(tag: &MemberTag) -> Option<Arc<str>> {
    MemberTag::taggable(&tag.mesh).then(|| format!("{TAG_MARK}{tag} ").into())
}

/// Marks the current thread as running `tag`'s life (`None`: no member):
/// [`ProcStderr`] prefixes what is logged on it.
pub(crate) fn set_thread_member(tag: Option<&MemberTag>) {
    let prefix = tag.and_then(member_prefix);
    MEMBER.with(|m| *m.borrow_mut() = prefix);
}

/// Runs `work` with the thread marked as `prefix`'s member while it is
/// polled, and as before between polls: for a member whose code runs as a
/// task on a thread it shares with others (the proc's control thread).
pub(crate) async fn as_member<F: Future>(prefix: Option<&Arc<str>>, work: F) -> F::Output {
    let Some(prefix) = prefix else {
        return work.await;
    };
    let mut work = std::pin::pin!(work);
    std::future::poll_fn(|cx| {
        let _marked = Marked::new(prefix);
        work.as_mut().poll(cx)
    })
    .await
}

/// The thread marked as a member's while this lives; the mark before comes
/// back when it is dropped, also when the member's code panics (the panic
/// is caught further up, and the thread goes on running other code).
struct Marked(Option<Arc<str>>);

impl Marked {
    fn new(prefix: &Arc<str>) -> Self {
        Self(MEMBER.with(|m| m.replace(Some(prefix.clone()))))
    }
}

impl Drop for Marked {
    fn drop(&mut self) {
        let before = self.0.take();
        MEMBER.with(|m| *m.borrow_mut() = before);
    }
}

/// A `tracing_subscriber` writer for procs: stderr, with every event
/// written on a member's thread prefixed by the member's [`MemberTag`]
/// (`tracing_subscriber::fmt().with_writer(ProcStderr)`). The controller
/// reads the tag back and prints the line as the member's.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcStderr;

/// The writer of one event ([`ProcStderr`]).
#[derive(Debug)]
pub struct ProcStderrWriter {
    stderr: std::io::StderrLock<'static>,
    prefix: Option<Arc<str>>,
}

impl std::io::Write for ProcStderrWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if let Some(prefix) = self.prefix.take() {
            self.stderr.write_all(prefix.as_bytes())?;
        }
        self.stderr.write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.stderr.flush()
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for ProcStderr {
    type Writer = ProcStderrWriter;

    fn make_writer(&'a self) -> Self::Writer {
        ProcStderrWriter {
            stderr: std::io::stderr().lock(),
            prefix: MEMBER.with(|m| m.borrow().clone()),
        }
    }
}

/// What the controller does with procs' lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogMode {
    /// Print each line with its prefix, the same line from several ranks
    /// once (`[train r0-3 g1] text`).
    #[default]
    Fold,
    /// Print every line with its prefix.
    All,
    /// Print every line as a JSON object
    /// (`{"proc":..,"mesh":..,"rank":..,"gen":..,"stream":..,"line":..}`).
    Json,
    /// Print nothing (subscribers still get every line).
    Off,
}

impl FromStr for LogMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "fold" => Ok(Self::Fold),
            "all" => Ok(Self::All),
            "json" => Ok(Self::Json),
            "off" => Ok(Self::Off),
            other => Err(format!("log mode {other:?} is not fold, all, json or off")),
        }
    }
}

impl fmt::Display for LogMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Fold => "fold",
            Self::All => "all",
            Self::Json => "json",
            Self::Off => "off",
        })
    }
}

/// How the controller's [`LogSink`] works, with documented defaults.
#[derive(Debug, Clone)]
pub struct LogConfig {
    /// What to print. Default [`LogMode::Fold`].
    pub mode: LogMode,
    /// How long a line waits for the same line from other ranks before it
    /// is printed ([`LogMode::Fold`]). Default 200 ms.
    pub fold_window: Duration,
    /// Lines queued at the sink; past it, senders wait (and host agents
    /// drop and count). Default 4096.
    pub buffer: NonZeroUsize,
}

impl Default for LogConfig {
    fn default() -> Self {
        Self {
            mode: LogMode::Fold,
            fold_window: Duration::from_millis(200),
            buffer: NonZeroUsize::new(4096).expect("4096 is not zero"),
        }
    }
}

impl LogConfig {
    /// Sets the mode.
    pub fn mode(mut self, mode: LogMode) -> Self {
        self.mode = mode;
        self
    }

    /// Sets the fold window.
    pub fn fold_window(mut self, window: Duration) -> Self {
        self.fold_window = window;
        self
    }
}

/// Who wrote a record: a member (from its tag) or a proc.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LogSource {
    /// A member's life: the mesh and the generation (ranks in the record).
    Member {
        /// The mesh.
        mesh: String,
        /// The generation.
        generation: u64,
    },
    /// A proc's raw output: its proc mesh (`p0` of proc `p0-3`; ranks in
    /// the record), or the whole proc id if it has no rank.
    Proc(String),
}

/// What the sink emits: one line, or one line from several ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogRecord {
    /// Who.
    pub source: LogSource,
    /// The ranks (members', or procs' in their proc mesh), sorted; empty
    /// for a proc without a rank.
    pub ranks: Vec<u32>,
    /// The first proc that wrote it.
    pub proc: ProcId,
    /// Which stream.
    pub stream: LogStream,
    /// The text, without the tag.
    pub text: String,
}

impl LogRecord {
    /// The record of one line.
    pub fn of(line: LogLine) -> Self {
        if let Some((tag, rest)) = MemberTag::parse(&line.text) {
            // tracing pads its level (" INFO"): the tag already separates.
            let text = rest.trim_start().to_owned();
            return Self {
                source: LogSource::Member {
                    mesh: tag.mesh,
                    generation: tag.generation,
                },
                ranks: vec![tag.rank],
                proc: line.proc,
                stream: line.stream,
                text,
            };
        }
        let id = line.proc.as_str();
        let (source, ranks) = match id.rsplit_once('-') {
            Some((mesh, rank)) if !mesh.is_empty() => match digits(rank).map(u32::try_from) {
                Some(Ok(rank)) => (LogSource::Proc(mesh.to_owned()), vec![rank]),
                _ => (LogSource::Proc(id.to_owned()), Vec::new()),
            },
            _ => (LogSource::Proc(id.to_owned()), Vec::new()),
        };
        Self {
            source,
            ranks,
            proc: line.proc,
            stream: line.stream,
            text: line.text,
        }
    }

    /// The prefix: `[train r0-3 g1]`, `[p0 r2]`, `[host-a]`.
    pub fn prefix(&self) -> String {
        let ranks = compress_ranks(&self.ranks);
        match &self.source {
            LogSource::Member { mesh, generation } => format!("[{mesh} r{ranks} g{generation}]"),
            LogSource::Proc(name) if ranks.is_empty() => format!("[{name}]"),
            LogSource::Proc(name) => format!("[{name} r{ranks}]"),
        }
    }

    /// The record as a JSON object (one line).
    pub fn to_json(&self) -> String {
        let (mesh, generation) = match &self.source {
            LogSource::Member { mesh, generation } => (Some(mesh.as_str()), Some(*generation)),
            LogSource::Proc(_) => (None, None),
        };
        let rank = match self.ranks.as_slice() {
            [one] => serde_json::json!(one),
            [] => serde_json::Value::Null,
            many => serde_json::json!(many),
        };
        serde_json::json!({
            "proc": self.proc.as_str(),
            "mesh": mesh,
            "rank": rank,
            "gen": generation,
            "stream": self.stream.as_str(),
            "line": self.text,
        })
        .to_string()
    }

    /// The record as `mode` prints it (`None` for [`LogMode::Off`]).
    pub fn render(&self, mode: LogMode) -> Option<String> {
        match mode {
            LogMode::Fold | LogMode::All => Some(format!("{} {}", self.prefix(), self.text)),
            LogMode::Json => Some(self.to_json()),
            LogMode::Off => None,
        }
    }
}

/// Ranks as ranges: `0-3,5,7-8`.
pub fn compress_ranks(ranks: &[u32]) -> String {
    let mut out = String::new();
    let mut i = 0;
    while i < ranks.len() {
        let start = ranks[i];
        let mut end = start;
        while i + 1 < ranks.len() && ranks[i + 1] == end.wrapping_add(1) {
            i += 1;
            end = ranks[i];
        }
        if !out.is_empty() {
            out.push(',');
        }
        if start == end {
            out.push_str(&start.to_string());
        } else {
            out.push_str(&format!("{start}-{end}"));
        }
        i += 1;
    }
    out
}

/// The most records waiting to be folded; past it the oldest is emitted.
const MAX_FOLDING: usize = 1024;

struct Folding {
    record: LogRecord,
    ranks: BTreeSet<u32>,
    until: Instant,
}

/// Folds identical lines from several ranks within a window (pure: the
/// caller passes the time). Records leave in the order their first line
/// came, so each rank's lines stay in order.
pub(crate) struct Folder {
    window: Duration,
    open: VecDeque<Folding>,
}

impl Folder {
    pub(crate) fn new(window: Duration) -> Self {
        Self {
            window,
            open: VecDeque::new(),
        }
    }

    /// Takes one line's record; returns the records that must leave now.
    pub(crate) fn push(&mut self, now: Instant, record: LogRecord) -> Vec<LogRecord> {
        let mut out = self.due(now);
        let rank = match record.ranks.as_slice() {
            [rank] => Some(*rank),
            _ => None,
        };
        let same = |f: &Folding| {
            f.record.source == record.source
                && f.record.stream == record.stream
                && f.record.text == record.text
                && !f.ranks.is_empty()
        };
        if let Some(rank) = rank
            && let Some(i) = self.open.iter().position(same)
        {
            if self.open[i].ranks.insert(rank) {
                return out;
            }
            // The same rank said it again: what came before goes first.
            out.extend(self.open.drain(..=i).map(Folding::finish));
        }
        if self.open.len() == MAX_FOLDING
            && let Some(oldest) = self.open.pop_front()
        {
            out.push(oldest.finish());
        }
        self.open.push_back(Folding {
            ranks: rank.into_iter().collect(),
            until: now + self.window,
            record,
        });
        out
    }

    /// The records whose window is over at `now`.
    pub(crate) fn due(&mut self, now: Instant) -> Vec<LogRecord> {
        let mut out = Vec::new();
        while self.open.front().is_some_and(|f| f.until <= now) {
            out.extend(self.open.pop_front().map(Folding::finish));
        }
        out
    }

    /// When the next record's window ends.
    pub(crate) fn next_due(&self) -> Option<Instant> {
        self.open.front().map(|f| f.until)
    }

    /// Every record still open.
    pub(crate) fn drain(&mut self) -> Vec<LogRecord> {
        self.open.drain(..).map(Folding::finish).collect()
    }
}

impl Folding {
    fn finish(mut self) -> LogRecord {
        if !self.ranks.is_empty() {
            self.record.ranks = self.ranks.into_iter().collect();
        }
        self.record
    }
}

/// Records kept for slow subscribers (a lagging one skips the oldest).
const SUBSCRIBER_BUFFER: usize = 1024;

/// The controller's end of procs' output: prints records as its
/// [`LogConfig`] says and hands them to subscribers. Cheap to share.
#[derive(Debug)]
pub struct LogSink {
    lines: mpsc::Sender<LogLine>,
    records: broadcast::Sender<LogRecord>,
    mode: LogMode,
    dropped: AtomicU64,
}

impl LogSink {
    /// Starts a sink (its task ends when the last sender is gone). Must be
    /// called within a tokio runtime.
    pub fn start(config: &LogConfig) -> Arc<Self> {
        let (lines, rx) = mpsc::channel(config.buffer.get());
        let (records, _) = broadcast::channel(SUBSCRIBER_BUFFER);
        let sink = Arc::new(Self {
            lines,
            records: records.clone(),
            mode: config.mode,
            dropped: AtomicU64::new(0),
        });
        let fold = (config.mode == LogMode::Fold).then_some(config.fold_window);
        tokio::spawn(run_sink(rx, records, config.mode, fold));
        sink
    }

    /// The mode it prints in.
    pub fn mode(&self) -> LogMode {
        self.mode
    }

    /// What the sink emits from now on: the folded records in
    /// [`LogMode::Fold`], every line's record otherwise (also in
    /// [`LogMode::Off`]).
    pub fn subscribe(&self) -> broadcast::Receiver<LogRecord> {
        self.records.subscribe()
    }

    /// Takes one line, waiting while the sink's queue is full.
    pub async fn send(&self, line: LogLine) {
        if self.lines.send(line).await.is_err() {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Takes every line of `lines` until it closes (a task of its own).
    pub fn feed(
        self: &Arc<Self>,
        mut lines: mpsc::Receiver<LogLine>,
    ) -> tokio::task::JoinHandle<()> {
        let sink = Arc::downgrade(self);
        tokio::spawn(async move {
            while let Some(line) = lines.recv().await {
                let Some(sink) = sink.upgrade() else { return };
                sink.send(line).await;
            }
        })
    }

    /// Lines lost because the sink had stopped.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

async fn run_sink(
    mut lines: mpsc::Receiver<LogLine>,
    records: broadcast::Sender<LogRecord>,
    mode: LogMode,
    fold: Option<Duration>,
) {
    let emit = |record: LogRecord| {
        if let Some(text) = record.render(mode) {
            // A closed stderr loses the line; nothing else can be done.
            let _ = writeln!(std::io::stderr().lock(), "{text}");
        }
        let _ = records.send(record);
    };
    let mut folder = fold.map(Folder::new);
    loop {
        let due = folder.as_ref().and_then(Folder::next_due);
        tokio::select! {
            biased;
            () = sleep_until_opt(due) => {
                if let Some(f) = folder.as_mut() {
                    f.due(Instant::now()).into_iter().for_each(emit);
                }
            }
            line = lines.recv() => match line {
                Some(line) => {
                    let record = LogRecord::of(line);
                    match folder.as_mut() {
                        Some(f) => f.push(Instant::now(), record).into_iter().for_each(emit),
                        None => emit(record),
                    }
                }
                None => break,
            },
        }
    }
    if let Some(f) = folder.as_mut() {
        f.drain().into_iter().for_each(emit);
    }
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests;
