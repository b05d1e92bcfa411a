//! A proc for the two-process suite of `regent-net` (`tests/tests/net.rs`).
//!
//! It binds an endpoint with credentials from files, opens two ports, and
//! talks to the test over its standard streams:
//!
//! - `echo[0]#0` sends every [`Probe`] with a `reply_to` back there;
//! - `record[0]#0` prints `GOT <sender> <stream> <n> <seq>` for each one.
//!
//! Standard output also carries `READY <addr> <incarnation>` once bound and
//! `EVENT ...` for every transport event. Standard input takes commands:
//! `route <addr>`, `send <port> <stream> <first n> <count> <pad bytes>`
//! (answered with `SENT <stream> <count>` or `SENDERR <failure>`) and
//! `stats` (answered with `STATS <handshakes in flight> <pending> <retried>
//! <refused>`).
//!
//! Arguments: `--proc NAME --cert FILE --key FILE --ca FILE [--bind ADDR]
//! [--unchecked] [--failure-timeout-ms N] [--reconnect-timeout-ms N]
//! [--max-frame-bytes N]`. `--unchecked` loads a certificate that may not
//! name the proc (to play a proc lying about its identity).

#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::time::Duration;

use regent_net::{
    Endpoint, EndpointConfig, Generation, PortId, ProcAddr, ProcCredentials, ProcId,
    TransportEvent, UndeliveredCause,
};
use regent_tests::peers::net::Probe;
use tokio::io::AsyncBufReadExt as _;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    regent_tests::peers::init_peer_tracing();
    let mut args: HashMap<String, String> = HashMap::new();
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let key = flag.trim_start_matches("--").to_owned();
        if key == "unchecked" {
            args.insert(key, String::new());
        } else {
            let value = it.next().ok_or(format!("{flag} needs a value"))?;
            args.insert(key, value);
        }
    }
    let arg = |k: &str| args.get(k).cloned().ok_or(format!("--{k} is required"));
    let proc = ProcId::new(&arg("proc")?)?;
    let cert = std::fs::read_to_string(arg("cert")?)?;
    let key = std::fs::read_to_string(arg("key")?)?;
    let ca = std::fs::read_to_string(arg("ca")?)?;
    let credentials = if args.contains_key("unchecked") {
        ProcCredentials::danger_unchecked_from_pem(proc.clone(), &cert, &key, &ca)?
    } else {
        ProcCredentials::from_pem(proc.clone(), &cert, &key, &ca)?
    };
    let mut config = EndpointConfig::default();
    if let Some(ms) = args.get("failure-timeout-ms") {
        config = config.failure_timeout(Duration::from_millis(ms.parse()?));
    }
    if let Some(ms) = args.get("reconnect-timeout-ms") {
        config = config.reconnect_timeout(Duration::from_millis(ms.parse()?));
    }
    if let Some(n) = args.get("max-frame-bytes") {
        config = config.max_frame_bytes(n.parse()?);
    }
    let bind = args
        .get("bind")
        .map_or("127.0.0.1:0", String::as_str)
        .parse()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(run(proc, credentials, bind, config))
}

async fn run(
    proc: ProcId,
    credentials: ProcCredentials,
    bind: std::net::SocketAddr,
    config: EndpointConfig,
) -> Result<(), Box<dyn std::error::Error>> {
    let endpoint = Endpoint::bind(credentials, bind, config)?;
    let mut events = endpoint.take_events().ok_or("events taken")?;
    let echo_actor = proc.actor("echo", 0)?;
    let mut echo = endpoint.open_port(echo_actor.port(0))?;
    let mut record = endpoint.open_port(proc.actor("record", 0)?.port(0))?;

    tokio::spawn(async move {
        while let Some(event) = events.recv().await {
            println!("EVENT {}", describe(&event));
        }
    });
    let ep = endpoint.clone();
    tokio::spawn(async move {
        while let Some(d) = echo.recv().await {
            let Ok(probe) = d.decode::<Probe>() else {
                println!("BADMSG");
                continue;
            };
            if let Some(to) = probe.reply_to.clone()
                && let Err(e) = ep.send(&echo_actor, &to, Generation(0), probe).await
            {
                println!("SENDERR {}", e.failure);
            }
        }
    });
    tokio::spawn(async move {
        while let Some(d) = record.recv().await {
            let sender = d.sender.clone();
            let seq = d.seq.0;
            match d.decode::<Probe>() {
                Ok(p) => println!("GOT {sender} {} {} {seq}", p.stream, p.n),
                Err(e) => println!("BADMSG {e}"),
            }
        }
    });
    println!("READY {} {}", endpoint.addr(), endpoint.incarnation());

    let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).lines();
    while let Some(line) = lines.next_line().await? {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["route", addr] => endpoint.add_route(addr.parse::<ProcAddr>()?),
            ["send", to, stream, first, count, pad] => {
                let to: PortId = to.parse()?;
                let stream: u32 = stream.parse()?;
                let first: u64 = first.parse()?;
                let count: u64 = count.parse()?;
                let pad = vec![0xab; pad.parse()?];
                let from = proc.actor("sender", stream)?;
                let mut failed = None;
                for n in first..first + count {
                    let probe = Probe {
                        stream,
                        n,
                        reply_to: None,
                        pad: pad.clone(),
                    };
                    if let Err(e) = endpoint.send(&from, &to, Generation(0), probe).await {
                        failed = Some(e.failure);
                        break;
                    }
                }
                match failed {
                    None => println!("SENT {stream} {count}"),
                    Some(f) => println!("SENDERR {f}"),
                }
            }
            ["stats"] => {
                let s = endpoint.handshake_stats();
                println!(
                    "STATS {} {} {} {}",
                    s.in_flight, s.pending, s.retried, s.refused
                );
            }
            _ => println!("BADCMD {line}"),
        }
    }
    // The test closed our input: exit.
    endpoint.close();
    Ok(())
}

fn describe(event: &TransportEvent) -> String {
    match event {
        TransportEvent::LinkUp {
            peer,
            direction,
            resumed,
            ..
        } => format!("LINKUP {peer} {direction:?} resumed={resumed}"),
        TransportEvent::LinkFailed {
            peer,
            direction,
            cause,
        } => format!("LINKFAILED {peer} {direction:?} {cause}"),
        TransportEvent::LinkClosed { peer, cause } => format!("LINKCLOSED {peer} {cause}"),
        TransportEvent::PeerRestarted { peer, .. } => format!("RESTARTED {peer}"),
        TransportEvent::Refused {
            claimed, reason, ..
        } => format!("REFUSED {claimed:?} {reason}"),
        TransportEvent::ProtocolViolation { peer, error } => format!("VIOLATION {peer} {error}"),
        TransportEvent::Undeliverable(u) => {
            let what = regent_net::wire::decode_body::<Probe>(&u.envelope.payload)
                .map(|p| format!("{} {}", p.stream, p.n))
                .unwrap_or_else(|e| format!("undecodable {e}"));
            let cause = match &u.cause {
                UndeliveredCause::Rejected(c) => format!("rejected {c}"),
                other => other.to_string(),
            };
            format!("UNDELIVERABLE {what} {cause}")
        }
    }
}
