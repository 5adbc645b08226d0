//! Command-line arguments (clap derive): the run's options, and the hidden `peer` subcommand
//! the bench re-executes itself with for each side of a measurement.
use clap::{Args, Parser, Subcommand, ValueEnum};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Parser, Debug)]
#[command(
    name = "kvlink-bench",
    version,
    about = "kvlink between two processes on loopback, next to ucx_perftest on the same transport",
    long_about = "kvlink between two processes on loopback, next to ucx_perftest on the same transport.\n\n\
For each transport it runs, size by size: ucx_perftest tag_bw -O 1 and tag_lat (the raw UCX \
baseline; an in-flight row of 64 KiB and up also gets tag_bw -O N, N its in-flight count), the kvlink transport row (the agent's tagged send/recv, one transfer at a time), \
whole kvlink requests one at a time, and the in-flight rows (N requests in flight at all \
times: as the oldest ends, its bytes are checked and its buffer is advertised again). Each kvlink row starts two fresh processes (this binary, re-executed as the \
generation and the context side); a row that does not finish within --row-timeout is reported \
with its failure count and the run goes on.\n\n\
Figures: GB/s = 1e9 bytes/s; us/req = wall time of a round divided by its requests (p50, p99 \
over rounds; for one in flight that is one request end to end; for an in-flight row, a round \
is N consecutive ends, timed from the previous round's last end; for the transport row, one \
transfer from post to completion on the sender); x tag_bw = kvlink GB/s over \
tag_bw GB/s at the same size; x tag_lat = kvlink us/req p50 over tag_lat one-way p50; x -O N \
= an in-flight row's GB/s over tag_bw -O N GB/s. The \
machine is shared and noisy: compare rows of one run, not runs.",
    args_conflicts_with_subcommands = true
)]
pub struct Cli {
    #[command(subcommand)]
    pub peer: Option<PeerCmd>,
    #[command(flatten)]
    pub run: RunArgs,
}

#[derive(Subcommand, Debug)]
pub enum PeerCmd {
    /// One side of a measurement (started by the bench itself).
    #[command(hide = true)]
    Peer(PeerArgs),
    /// The protocol core's own CPU cost per request, in this one process, no transport: two
    /// endpoints with the engine's defaults pass a whole request's messages (encoded and
    /// decoded), events and actions. Compare before and after a change to `kvlink-proto/`.
    Core(CoreArgs),
    /// This machine's memory copy rate, in this one process: one hot source copied into one
    /// buffer, and into several used in turn. `ucx_perftest -O N` lands all N operations in one
    /// buffer; N requests in flight need N buffers (see the README, "Tests and figures").
    Copy(CopyArgs),
}

#[derive(Args, Debug, Clone)]
pub struct CopyArgs {
    /// Bytes per copy (or with K/KiB, M/MiB, G/GiB).
    #[arg(long, value_parser = parse_size, default_value = "1MiB")]
    pub size: u64,
    /// Destination buffers used in turn, comma-separated counts.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16")]
    pub buffers: Vec<usize>,
    /// Measured rounds per count (of at least 256 MiB each, and at least one copy into each
    /// buffer); the median is printed.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    pub rounds: u32,
}

#[derive(Args, Debug, Clone)]
pub struct CoreArgs {
    /// Requests per round.
    #[arg(long, default_value_t = 50_000)]
    pub requests: u64,
    /// Requests in flight: each request is started (advertised and accepted) this many
    /// requests before its data lands and its verdict passes, as in the bench's in-flight rows;
    /// 1 completes each before the next starts. The pool holds this many requests' buffers.
    #[arg(long, default_value_t = 1)]
    pub inflight: u64,
    /// Buffers (segments) per request.
    #[arg(long, default_value_t = 1)]
    pub segments: u32,
    /// Simulated time between requests, microseconds. A finished request is remembered 5 s: at
    /// 1000 (1000 requests/s) each endpoint knows about 5000; 10 keeps every request of a round.
    #[arg(long, default_value_t = 1000)]
    pub spacing_us: u64,
    /// Rounds, each with fresh endpoints; the best and the median are printed.
    #[arg(long, default_value_t = 5)]
    pub rounds: u32,
}

#[derive(Args, Debug, Clone)]
pub struct RunArgs {
    /// Transports to measure, comma-separated: tcp, sm (shared memory).
    #[arg(long, value_delimiter = ',', default_value = "tcp,sm")]
    pub transports: Vec<Transport>,

    /// Sizes of the one-request-in-flight rows (bytes, or with K/KiB, M/MiB, G/GiB).
    #[arg(long, value_delimiter = ',', value_parser = parse_size,
          default_value = "4KiB,1MiB,16MiB,64MiB")]
    pub sizes: Vec<u64>,

    /// In-flight rows, SIZE:N comma-separated: N requests of SIZE in flight at all times, as
    /// `ucx_perftest -O N` keeps N operations outstanding. The generation side waits for the
    /// oldest, checks its bytes and advertises its buffer again as a new request; every N ends
    /// make a round, for --rounds rounds. The checks are timed (they overlap the other
    /// requests' transfers): in measured rounds one 8-byte word per 4 KiB and the last 8
    /// bytes (the two patterns differ in every byte), every byte in the warm-up and trailing
    /// rounds. One-at-a-time rows check the same way, untimed.
    #[arg(long, value_delimiter = ',', value_parser = parse_batch,
          default_value = "4KiB:64,4KiB:1024,4KiB:4096,1MiB:8")]
    pub inflight: Vec<(u64, u64)>,

    /// Measured requests per one-in-flight row, and transfers per transport row [default: as
    /// many as ucx_perftest times at that size (its byte budget over the size, 100 to 10000:
    /// 10000 at 4 KiB, 256 at 1 MiB, 100 at 16 and 64 MiB); --quick: 10]. Given, it is also the
    /// fewest ucx_perftest iterations per size. A kvlink row measured over a few milliseconds
    /// (50 requests of 1 MiB) is at the mercy of one descheduling on a shared machine; its
    /// baseline, measured over the same number of messages, is not.
    #[arg(long)]
    pub iters: Option<u64>,

    /// Warm-up requests before each one-in-flight row [default: as many as ucx_perftest
    /// warms up at that size, a tenth of its iterations and at least 3 (1000 at 4 KiB, 25 at
    /// 1 MiB); --quick: 1], and transfers before each transport row [default: 3]. A fresh
    /// pair's first few hundred small requests are slower than the rest, as are
    /// ucx_perftest's first iterations, which it does not time. The transport row's sender is
    /// not paced by its receiver: after a long warm-up of small (eager) sends it is hundreds
    /// ahead, and its measured sends wait for the socket to drain.
    #[arg(long)]
    pub warmup: Option<u64>,

    /// Measured rounds (of N requests) per in-flight row [default: enough for as many requests
    /// as ucx_perftest times at that size, and at least 5 (157 rounds of 64 at 4 KiB, 32 of 8
    /// at 1 MiB); --quick: 2]. One warm-up round comes first, and one unmeasured round after
    /// them keeps the window full to the end of the last measured one.
    #[arg(long)]
    pub rounds: Option<u64>,

    /// Context-side threads that accept and send the advertised requests.
    #[arg(long, default_value_t = 4)]
    pub senders: u64,

    /// Idle pause, in microseconds, between the requests of the one-in-flight rows (not
    /// timed; the in-flight rows keep N in flight and ignore it): requests that arrive apart,
    /// as in serving, instead of back to back. Every thread of both
    /// sides is then asleep when a request starts, so its figure includes the wake-ups that
    /// back-to-back rows hide behind polling.
    #[arg(long, default_value_t = 0, value_name = "US")]
    pub gap_us: u64,

    /// What the transport row's sender sends from. `untouched`: a buffer on huge pages that
    /// is never written, as `ucx_perftest`'s sender sends (its buffer is mapped by UCX and
    /// never filled, so the kernel reads the shared huge zero page, which stays in cache);
    /// `pattern`: the whole-request rows' pattern, memory that has to be read from DRAM at 16
    /// MiB and up. Whole-request rows always send patterns, since their bytes are checked.
    #[arg(long, value_enum, default_value_t = Source::Untouched)]
    pub tr_source: Source,

    /// Buffers the transport row's receiver receives into, in turn (one per transfer).
    /// `ucx_perftest` lands every transfer in one buffer, hot in cache; N requests in flight
    /// land in N buffers, and `--tr-buffers N` gives the transport row that memory to write.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub tr_buffers: u64,

    /// Each process of a pair on CPUs of its own, `ucx_perftest`'s pairs and kvlink's alike:
    /// the listening side (`ucx_perftest`'s server, the context side, the transport row's
    /// receiver) on the first half of the CPUs this process may use, the other side on the
    /// second half. In serving the two engines run on different hosts; on loopback, unpinned,
    /// the scheduler moves the threads of both processes across the same cores, which costs
    /// kvlink (a progress thread beside its callers) more than the single-threaded baseline.
    /// `auto` pins when there are two CPUs or more; `off` leaves placement to the scheduler.
    #[arg(long, value_enum, default_value_t = Pin::Auto)]
    pub pin: Pin,

    /// Time limit of one row in seconds: requests not done by then count as failed (the
    /// "failed" column counts the whole row, warm-up included), and both processes are stopped
    /// [default: 60, --quick: 10].
    #[arg(long)]
    pub row_timeout: Option<u64>,

    /// A fast smoke run: few iterations, short time limits (well under a minute for tcp and
    /// sm together when nothing breaks). Explicit flags still win.
    #[arg(long)]
    pub quick: bool,

    /// Skip ucx_perftest (no ratios).
    #[arg(long)]
    pub no_perftest: bool,

    /// Skip the kvlink transport rows.
    #[arg(long)]
    pub no_transport: bool,

    /// Write the results as JSON to this file ("-" for standard output; the table then goes
    /// to standard error).
    #[arg(long, value_name = "PATH")]
    pub json: Option<PathBuf>,

    /// Write the results as CSV (one record per row) to this file.
    #[arg(long, value_name = "PATH")]
    pub csv: Option<PathBuf>,

    /// Draw GB/s and us per request against size (kvlink beside ucx_perftest, one panel pair
    /// per transport) into this PNG file.
    #[arg(long, value_name = "PATH")]
    pub plot: Option<PathBuf>,

    /// No progress bar (it is also hidden when standard error is not a terminal).
    #[arg(long)]
    pub no_progress: bool,

    /// Serve the generation side's Prometheus metrics on this ip:port (plain HTTP GET) while
    /// each whole-request row runs: watch a row from outside, e.g. `curl IP:PORT/metrics`.
    #[arg(long, value_name = "IP:PORT")]
    pub metrics_listen: Option<String>,
}

impl RunArgs {
    /// `--iters`, or its default floor (100; --quick: 10): the fewest ucx_perftest iterations.
    pub fn iters(&self) -> u64 {
        self.iters
            .unwrap_or(if self.quick { 10 } else { 100 })
            .max(1)
    }

    /// Requests per one-in-flight row when every such row has the same count: `--iters`, or
    /// --quick's 10. None: as many as ucx_perftest at each size ([`RunArgs::iters_for`]).
    pub fn fixed_iters(&self) -> Option<u64> {
        (self.iters.is_some() || self.quick).then(|| self.iters())
    }

    /// Rounds per in-flight row when every such row has the same count: `--rounds`, or
    /// --quick's 2. None: as ucx_perftest's requests at each size ([`RunArgs::rounds_for`]).
    pub fn fixed_rounds(&self) -> Option<u64> {
        (self.rounds.is_some() || self.quick).then(|| self.rounds())
    }

    /// Measured requests (transfers) of a one-in-flight (transport) row of `size` bytes: `--iters`
    /// when given, else as many as ucx_perftest times at that size.
    pub fn iters_for(&self, size: u64) -> u64 {
        self.fixed_iters()
            .unwrap_or_else(|| self.perftest_iters(size))
    }

    /// Measured rounds of an in-flight row of `n` requests of `size` bytes: `--rounds` when
    /// given, else enough rounds for as many requests as ucx_perftest times at that size, and
    /// at least the default 5.
    pub fn rounds_for(&self, size: u64, n: u64) -> u64 {
        self.fixed_rounds().unwrap_or_else(|| {
            self.perftest_iters(size)
                .div_ceil(n.max(1))
                .max(self.rounds())
        })
    }

    /// ucx_perftest's timed iterations at `size`.
    pub fn perftest_iters(&self, size: u64) -> u64 {
        crate::perftest::iterations(
            size,
            self.perftest_budget(),
            self.perftest_min(),
            self.perftest_max(),
        )
    }
    /// Warm-up transfers before a transport row (see `warmup`).
    pub fn transport_warmup(&self) -> u64 {
        self.warmup.unwrap_or(if self.quick { 1 } else { 3 })
    }

    /// Warm-up requests before a one-in-flight row of `size` bytes: the same
    /// count as ucx_perftest's warm-up at that size (`perftest::run` passes `-w` a tenth of
    /// its iterations), so kvlink and its baseline start measuring equally warm.
    pub fn warmup_for(&self, size: u64) -> u64 {
        self.warmup.unwrap_or_else(|| {
            if self.quick {
                1
            } else {
                crate::perftest::warmup_of(self.perftest_iters(size))
            }
        })
    }
    pub fn rounds(&self) -> u64 {
        self.rounds.unwrap_or(if self.quick { 2 } else { 5 }).max(1)
    }
    pub fn row_timeout(&self) -> Duration {
        Duration::from_secs(
            self.row_timeout
                .unwrap_or(if self.quick { 10 } else { 60 })
                .max(1),
        )
    }
    /// Fewest ucx_perftest iterations per size.
    pub fn perftest_min(&self) -> u64 {
        if self.quick {
            5
        } else {
            self.iters()
        }
    }
    /// Most ucx_perftest iterations per size.
    pub fn perftest_max(&self) -> u64 {
        if self.quick {
            1000
        } else {
            10_000
        }
    }
    /// Bytes ucx_perftest moves per size (its iteration count is this over the size, within
    /// [iters, perftest_max]).
    pub fn perftest_budget(&self) -> u64 {
        if self.quick {
            32 << 20
        } else {
            256 << 20
        }
    }
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum Transport {
    Tcp,
    Sm,
}

impl Transport {
    pub fn name(self) -> &'static str {
        match self {
            Transport::Tcp => "tcp",
            Transport::Sm => "sm",
        }
    }
    pub fn kind(self) -> kvlink::transport::TransportKind {
        match self {
            Transport::Tcp => kvlink::transport::TransportKind::Tcp,
            Transport::Sm => kvlink::transport::TransportKind::SharedMemory,
        }
    }
    /// The memory of the bench's buffers on this transport: where UCX would put
    /// `ucx_perftest`'s (see [`crate::hugebuf`]).
    pub fn backing(self) -> crate::hugebuf::Backing {
        match self {
            Transport::Tcp => crate::hugebuf::Backing::Thp,
            Transport::Sm => crate::hugebuf::Backing::Shm,
        }
    }

    /// `UCX_TLS` for ucx_perftest: the transports kvlink's agent selects for this kind.
    pub fn ucx_tls(self) -> &'static str {
        match self {
            Transport::Tcp => "tcp",
            Transport::Sm => "posix,sysv,self",
        }
    }
}

/// Where the processes of a pair run (`--pin`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum Pin {
    /// Pinned when this process may use two CPUs or more.
    Auto,
    /// Pinned; an error below two CPUs.
    On,
    /// Where the scheduler puts them.
    Off,
}

/// The transport row's send buffer (`--tr-source`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum Source {
    /// Mapped on huge pages and never written, as `ucx_perftest`'s.
    Untouched,
    /// The pattern the whole-request rows send.
    Pattern,
}

impl Source {
    pub fn name(self) -> &'static str {
        match self {
            Source::Untouched => "untouched",
            Source::Pattern => "pattern",
        }
    }
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum PeerRole {
    /// Generation side of whole requests: connects, advertises, waits, times.
    Gen,
    /// Context side: listens, accepts and sends every advertised request.
    Ctx,
    /// Transport row, receiving agent: listens, posts one receive at a time.
    TrRecv,
    /// Transport row, sending agent: connects, sends one transfer at a time, times.
    TrSend,
}

#[derive(Args, Debug, Clone)]
pub struct PeerArgs {
    #[arg(long)]
    pub role: PeerRole,
    #[arg(long)]
    pub transport: Transport,
    /// The listening side's address (gen, tr-send).
    #[arg(long)]
    pub peer: Option<String>,
    #[arg(long, value_parser = parse_size, default_value = "4096")]
    pub size: u64,
    #[arg(long, default_value_t = 1)]
    pub inflight: u64,
    /// Measured rounds (of `inflight` requests).
    #[arg(long, default_value_t = 1)]
    pub rounds: u64,
    /// Warm-up rounds.
    #[arg(long, default_value_t = 0)]
    pub warmup: u64,
    /// Context side: sender threads.
    #[arg(long, default_value_t = 4)]
    pub senders: u64,
    /// Time limit of the whole row, milliseconds.
    #[arg(long, default_value_t = 60_000)]
    pub limit_ms: u64,
    /// Generation side: idle pause between rounds, microseconds (not timed).
    #[arg(long, default_value_t = 0)]
    pub gap_us: u64,
    /// Transport row's sender: what it sends from.
    #[arg(long, value_enum, default_value_t = Source::Untouched)]
    pub tr_source: Source,
    /// Transport row's receiver: buffers it receives into, in turn.
    #[arg(long, default_value_t = 1)]
    pub tr_buffers: u64,
    /// Generation side: serve the engine's metrics on this ip:port while the row runs.
    #[arg(long, value_name = "IP:PORT")]
    pub metrics_listen: Option<String>,
}

impl PeerArgs {
    /// Requests the generation side advertises: for an in-flight row, one round more than
    /// warm-up and measured rounds (see [`PeerArgs::trailing_rounds`]).
    pub fn planned(&self) -> u64 {
        (self.rounds + self.warmup + self.trailing_rounds()) * self.inflight
    }

    /// An in-flight row advertises one round past its measured ones, so that the window stays
    /// full until the last measured request has ended (an emptying window would time only the
    /// checks of requests that had landed during the round before). Not measured.
    pub fn trailing_rounds(&self) -> u64 {
        u64::from(self.inflight > 1)
    }
}

/// Bytes, or a number with K/KiB, M/MiB, G/GiB (binary units).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("'{s}': expected a size such as 4096, 4KiB or 1MiB"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" | "kb" => 1 << 10,
        "m" | "mib" | "mb" => 1 << 20,
        "g" | "gib" | "gb" => 1 << 30,
        u => {
            return Err(format!(
                "'{s}': unknown unit '{u}' (use K, KiB, M, MiB, G or GiB)"
            ))
        }
    };
    match n.checked_mul(mult) {
        Some(0) | None => Err(format!("'{s}': size must be between 1 byte and 2^64")),
        Some(v) => Ok(v),
    }
}

/// `SIZE:N`, for example `4KiB:64`.
pub fn parse_batch(s: &str) -> Result<(u64, u64), String> {
    let (size, n) = s
        .split_once(':')
        .ok_or_else(|| format!("'{s}': expected SIZE:N, for example 4KiB:64"))?;
    let n: u64 = n
        .trim()
        .parse()
        .map_err(|_| format!("'{s}': N must be a number"))?;
    if n == 0 {
        return Err(format!("'{s}': N must be at least 1"));
    }
    Ok((parse_size(size)?, n))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn sizes_and_batches_parse() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("4KiB"), Ok(4096));
        assert_eq!(parse_size("1M"), Ok(1 << 20));
        assert_eq!(parse_size("64mib"), Ok(64 << 20));
        assert!(parse_size("0").is_err());
        assert!(parse_size("4XB").is_err());
        assert!(parse_size("é").is_err());
        assert_eq!(parse_batch("4KiB:1024"), Ok((4096, 1024)));
        assert!(parse_batch("4KiB").is_err());
        assert!(parse_batch("4KiB:0").is_err());
    }

    #[test]
    fn rows_measure_as_many_requests_as_ucx_perftest_unless_told() {
        let c = Cli::parse_from(["kvlink-bench"]);
        assert_eq!(c.run.iters_for(4096), 10_000);
        assert_eq!(c.run.iters_for(1 << 20), 256);
        assert_eq!(c.run.iters_for(64 << 20), 100);
        assert_eq!(c.run.iters_for(1 << 20), c.run.perftest_iters(1 << 20));
        assert_eq!(c.run.rounds_for(4096, 64), 157);
        assert_eq!(c.run.rounds_for(1 << 20, 8), 32);
        assert_eq!(c.run.rounds_for(4096, 4096), 5);
        let c = Cli::parse_from(["kvlink-bench", "--iters", "50", "--rounds", "3"]);
        assert_eq!(c.run.iters_for(4096), 50);
        assert_eq!(c.run.iters_for(64 << 20), 50);
        assert_eq!(c.run.rounds_for(4096, 64), 3);
        assert_eq!(c.run.perftest_iters(64 << 20), 50);
        let c = Cli::parse_from(["kvlink-bench", "--quick"]);
        assert_eq!(c.run.iters_for(4096), 10);
        assert_eq!(c.run.rounds_for(4096, 64), 2);
    }

    #[test]
    fn the_transport_row_sends_untouched_memory_unless_told() {
        let c = Cli::parse_from(["kvlink-bench"]);
        assert_eq!(c.run.tr_source, Source::Untouched);
        let c = Cli::parse_from(["kvlink-bench", "--tr-source", "pattern"]);
        assert_eq!(c.run.tr_source, Source::Pattern);
        // What the bench hands its peers parses back to the same value.
        for s in [Source::Untouched, Source::Pattern] {
            let c = Cli::parse_from([
                "kvlink-bench",
                "peer",
                "--role",
                "tr-send",
                "--transport",
                "tcp",
                "--tr-source",
                s.name(),
            ]);
            match c.peer {
                Some(PeerCmd::Peer(p)) => assert_eq!(p.tr_source, s),
                _ => panic!("not a peer command"),
            }
        }
    }

    #[test]
    fn the_transport_row_receives_into_one_buffer_unless_told() {
        assert_eq!(Cli::parse_from(["kvlink-bench"]).run.tr_buffers, 1);
        let c = Cli::parse_from(["kvlink-bench", "--tr-buffers", "8"]);
        assert_eq!(c.run.tr_buffers, 8);
        assert!(Cli::try_parse_from(["kvlink-bench", "--tr-buffers", "0"]).is_err());
        let c = Cli::parse_from([
            "kvlink-bench",
            "peer",
            "--role",
            "tr-recv",
            "--transport",
            "sm",
            "--tr-buffers",
            "8",
        ]);
        match c.peer {
            Some(PeerCmd::Peer(p)) => assert_eq!(p.tr_buffers, 8),
            _ => panic!("not a peer command"),
        }
    }

    #[test]
    fn the_copy_command_takes_a_size_and_buffer_counts() {
        assert!(Cli::try_parse_from(["kvlink-bench", "copy", "--rounds", "0"]).is_err());
        match Cli::parse_from([
            "kvlink-bench",
            "copy",
            "--size",
            "4KiB",
            "--buffers",
            "1,64",
        ])
        .peer
        {
            Some(PeerCmd::Copy(c)) => {
                assert_eq!(c.size, 4096);
                assert_eq!(c.buffers, vec![1, 64]);
            }
            _ => panic!("not the copy command"),
        }
    }

    #[test]
    fn quick_defaults() {
        let c = Cli::parse_from(["kvlink-bench", "--quick", "--iters", "7"]);
        assert_eq!(c.run.iters(), 7);
        assert_eq!(c.run.rounds(), 2);
        assert_eq!(c.run.row_timeout(), Duration::from_secs(10));
        assert_eq!(c.run.sizes, vec![4096, 1 << 20, 16 << 20, 64 << 20]);
        assert_eq!(c.run.inflight[3], (1 << 20, 8));
    }
}
