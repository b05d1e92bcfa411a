//! A proc for the two-process suite of `regent-rdma` (`tests/tests/rdma.rs`):
//! it starts a buffer manager with credentials from files and owns buffers
//! that the test reads and writes one-sidedly.
//!
//! Standard output carries `READY <pid>` once started. Standard input takes
//! commands, each answered on one line:
//!
//! - `alloc <len> <seed>`: registers `len` bytes filled with the pattern of
//!   `seed` (see [`fill`]); answers `HANDLE <id> <hex of the encoded handle>`.
//! - `release <id>`: releases the buffer; answers `RELEASED <id>`.
//! - `check <id> <seed>`: closes the buffer to peers (waiting for their
//!   copies in flight), compares it with the pattern of `seed` and reopens
//!   it; answers `SAME` or `DIFFERENT <first differing offset>`.
//! - `access <id> exposed|readonly|local`: sets the buffer's access;
//!   answers `ACCESS <id> <access>`, or `BUSY <error>`.
//! - `hold <id> <seed> <ms>`: holds the buffer locally for `ms`
//!   milliseconds, filled with the pattern of `seed`, then checks it and
//!   restores its access; answers `INTACT` or `CHANGED <first differing
//!   offset>` (a peer wrote it while it was held).
//!
//! Arguments: `--proc NAME --cert FILE --key FILE --ca FILE`.

#![forbid(unsafe_code)]

use std::collections::HashMap;

use regent_net::{ProcCredentials, ProcId};
use regent_rdma::{Access, BufferManager, LocalBuffer, ManagerConfig, Memory};
use regent_tests::peers::rdma::{fill, hex};
use tokio::io::AsyncBufReadExt as _;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    regent_tests::peers::init_peer_tracing();
    let mut args: HashMap<String, String> = HashMap::new();
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        args.insert(flag.trim_start_matches("--").to_owned(), value);
    }
    let arg = |k: &str| args.get(k).cloned().ok_or(format!("--{k} is required"));
    let proc = ProcId::new(&arg("proc")?)?;
    let creds = ProcCredentials::from_pem(
        proc,
        &std::fs::read_to_string(arg("cert")?)?,
        &std::fs::read_to_string(arg("key")?)?,
        &std::fs::read_to_string(arg("ca")?)?,
    )?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(serve(creds))
}

async fn serve(creds: ProcCredentials) -> Result<(), Box<dyn std::error::Error>> {
    let manager = BufferManager::start(ManagerConfig::default(), creds).await?;
    println!("READY {}", std::process::id());
    let mut buffers: HashMap<u64, LocalBuffer> = HashMap::new();
    let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).lines();
    while let Some(line) = lines.next_line().await? {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["alloc", len, seed] => {
                let mut memory = Memory::allocate(len.parse()?)?;
                fill(&mut memory, seed.parse()?);
                let buffer = manager.register(memory)?;
                let id = buffer.id().0;
                println!("HANDLE {id} {}", hex(&buffer.handle().encode()));
                buffers.insert(id, buffer);
            }
            ["release", id] => {
                let id: u64 = id.parse()?;
                if let Some(b) = buffers.remove(&id) {
                    manager.release(b);
                }
                println!("RELEASED {id}");
            }
            ["check", id, seed] => {
                let b = buffers.get_mut(&id.parse()?).ok_or("no such buffer")?;
                let mut expect = vec![0u8; b.len()];
                fill(&mut expect, seed.parse()?);
                let held = b.lock_local().await?;
                match first_difference(&held, &expect) {
                    None => println!("SAME"),
                    Some(at) => println!("DIFFERENT {at}"),
                }
            }
            ["access", id, access] => {
                let b = buffers.get_mut(&id.parse()?).ok_or("no such buffer")?;
                let access = match *access {
                    "exposed" => Access::Exposed,
                    "readonly" => Access::ReadOnly,
                    "local" => Access::Local,
                    other => return Err(format!("unknown access {other}").into()),
                };
                match b.set_access(access).await {
                    Ok(()) => println!("ACCESS {} {access:?}", b.id().0),
                    Err(e) => println!("BUSY {e}"),
                }
            }
            ["hold", id, seed, ms] => {
                let b = buffers.get_mut(&id.parse()?).ok_or("no such buffer")?;
                let mut expect = vec![0u8; b.len()];
                fill(&mut expect, seed.parse()?);
                let mut held = b.lock_local().await?;
                held.copy_from_slice(&expect);
                tokio::time::sleep(std::time::Duration::from_millis(ms.parse()?)).await;
                match first_difference(&held, &expect) {
                    None => println!("INTACT"),
                    Some(at) => println!("CHANGED {at}"),
                }
            }
            [] => {}
            other => println!("ERROR unknown command {other:?}"),
        }
    }
    Ok(())
}

fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter().zip(b).position(|(x, y)| x != y)
}
