//! Listen and connect addresses as an operator writes them, over real UCX tcp. An IPv6 one is
//! refused with `InvalidArgument`: before it was, a connection through an IPv6 listener
//! (`[::1]:0`) overflowed a heap block in UCX's tcp transport (`uct_tcp_ep_set_dest_addr`,
//! 1.13 and 1.22) and the process aborted in malloc ("double free or corruption"). A wildcard
//! listener (`0.0.0.0`) is reported at an address another host can dial, and a process restarted
//! at a dead one's `ip:port` listens there at once (UCX 1.22).
mod common;

use kvlink::transport::{Agent, AgentOptions, TransportKind};
use kvlink::{ErrorKind, Outcome};
use std::net::SocketAddr;
use std::process::Command;
use std::time::{Duration, Instant};

const ENGINE_PEER: &str = env!("CARGO_BIN_EXE_kvlink-engine-peer");

/// `kvlink-engine-peer ARGS` in network namespace `ns`.
fn in_ns(ns: &str, args: &[&str]) -> common::Proc {
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", ns, ENGINE_PEER]).args(args);
    common::Proc::spawn(cmd)
}

/// Request `id` through a `kvlink-engine-peer` pair, which must complete on both sides with
/// every byte checked.
fn completes(ctx: &mut common::Proc, gen: &mut common::Proc, id: u64) {
    gen.send(&format!("REQ {id}"));
    let g = gen.expect(&format!("GEN {id} "));
    let c = ctx.expect(&format!("CTX {id} "));
    assert!(
        g.contains("end=Completed") && g.contains("verified=true"),
        "{g}"
    );
    assert!(c.contains("end=Completed"), "{c}");
}

fn listener(at: &str) -> kvlink::Result<Agent> {
    let mut ob = AgentOptions::new("b", TransportKind::Tcp);
    ob.listen = Some(at.parse().unwrap());
    Agent::new(ob)
}

#[test]
fn an_ipv6_address_is_refused_to_listen_at_and_to_dial() {
    for at in ["[::1]:0", "[::]:0", "[fe80::1%1]:0", "[::ffff:127.0.0.1]:0"] {
        let e = listener(at)
            .err()
            .unwrap_or_else(|| panic!("listening at {at} was accepted"));
        assert_eq!(e.kind, ErrorKind::InvalidArgument, "{at}: {e}");
        assert!(e.message.contains("IPv6"), "{at}: {}", e.message);
        let e = kvlink::config::parse_listen_address(at).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidArgument, "{at}: {e}");
    }
    let a = Agent::new(AgentOptions::new("a", TransportKind::Tcp)).unwrap();
    let to: SocketAddr = "[::1]:9".parse().unwrap();
    let e = a
        .connect_by(to, Instant::now() + Duration::from_secs(5))
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidArgument, "{e}");
}

#[test]
fn an_ipv4_listener_at_port_0_is_reachable_at_the_address_it_reports() {
    for at in ["127.0.0.1:0", "0.0.0.0:0"] {
        let b = listener(at).unwrap();
        let bound = b.listen_address().unwrap();
        assert_ne!(bound.port(), 0, "{at}");
        let a = Agent::new(AgentOptions::new("a", TransportKind::Tcp)).unwrap();
        let ab = a
            .connect_by(bound, Instant::now() + Duration::from_secs(5))
            .unwrap();
        let mut hello = a.send_control(ab, b"hi".to_vec()).unwrap();
        let d = Instant::now() + Duration::from_secs(10);
        assert_eq!(hello.wait(d, None).unwrap(), Outcome::Completed, "{at}");
    }
}

/// A listener at the wildcard `0.0.0.0` is reached from another host at the address its engine
/// reports (`Engine::address`). Two network namespaces joined by a veth pair stand for the two
/// hosts (needs root, as the other namespace tests). Before, the engine reported `0.0.0.0:port`,
/// which on the other host means that host itself: the generation rank dialled its own
/// loopback and its `connect` failed. The TensorRT-LLM wrapper listens at `0.0.0.0:0` by
/// default and hands this address to the other instance, so no two hosts could pair.
#[test]
fn a_wildcard_listener_is_reached_from_another_host_at_the_address_it_reports() {
    let Some(net) = common::net::setup("wild") else {
        return;
    };
    // Without devices the one interface up besides loopback; with them the one named.
    let plain = ("tcp".to_string(), "tcp".to_string());
    let devices = (format!("tcp@{}", net.dev_b), format!("tcp@{}", net.dev_a));
    for (tb, ta) in [plain, devices] {
        println!("== {tb}: context rank listening at 0.0.0.0:0 in {}", net.b);
        let t = tb.as_str();
        let mut ctx = in_ns(&net.b, &["ctx", "--transport", t, "--listen", "0.0.0.0:0"]);
        let addr = ctx.expect_addr();
        let at: SocketAddr = addr.parse().unwrap_or_else(|e| panic!("{addr}: {e}"));
        assert_eq!(at.ip().to_string(), net.ip_b, "{t}: reported {addr}");
        assert_ne!(at.port(), 0, "{addr}");
        let mut gen = in_ns(
            &net.a,
            &["gen", "--transport", &ta, "--to", &addr, "--sizes", "4K,1M"],
        );
        gen.expect("CONNECTED");
        for id in 1..=2 {
            completes(&mut ctx, &mut gen, id);
        }
    }
}

/// An interface that is up but has no carrier (its cable out; here a veth whose other end is
/// down, as a `docker0` bridge with nothing attached) carries nothing to this host, and UCX
/// does not count it as active either: a wildcard listener is not published at its address,
/// though it comes first in the system's order. Before, `up` read `IFF_UP` alone and the
/// engine told its peers that address.
#[test]
fn a_wildcard_listener_is_not_published_at_an_interface_with_no_carrier() {
    let Some(net) = common::net::setup("nocar") else {
        return;
    };
    let (dead, dead_peer) = ("kvnocar0", "kvnocar1");
    let ns = |args: &[&str]| {
        let mut all = vec!["ip", "-n", &net.b];
        all.extend_from_slice(args);
        assert!(common::net::sh(&all), "ip {args:?}");
    };
    // Made after the veth moved in (which keeps the index it had), so numbered before it:
    // first in the system's order.
    ns(&[
        "link", "add", dead, "type", "veth", "peer", "name", dead_peer,
    ]);
    ns(&["addr", "add", "10.78.0.2/24", "dev", dead]);
    ns(&["link", "set", dead, "up"]);
    let shown = Command::new("ip")
        .args(["-n", &net.b, "-o", "-4", "addr", "show"])
        .output()
        .unwrap();
    let shown = String::from_utf8_lossy(&shown.stdout).into_owned();
    let at = |what: &str| {
        shown
            .find(what)
            .unwrap_or_else(|| panic!("{what}: {shown}"))
    };
    assert!(at(dead) < at(&net.dev_b), "not first in order:\n{shown}");
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &net.b, ENGINE_PEER]).args([
        "ctx",
        "--transport",
        "tcp",
        "--listen",
        "0.0.0.0:0",
    ]);
    let mut ctx = common::Proc::spawn(cmd);
    let addr = ctx.expect_addr();
    let at: SocketAddr = addr.parse().unwrap_or_else(|e| panic!("{addr}: {e}"));
    assert_eq!(at.ip().to_string(), net.ip_b, "reported {addr}:\n{shown}");
}

/// A context rank killed and started again at its `--listen` ip:port, as a supervisor restarts
/// it on its host, listens there at once, and its generation rank on the other host (network
/// namespaces, as above) is served by it. A second live listener at that port is still refused.
/// Before, on UCX 1.22 over `tcp`, the new engine failed to start for up to a minute ("listen on
/// ...: UCX Device is busy"; UCX: `bind ... Address already in use`) while the connections the
/// killed listener had accepted lingered in TIME_WAIT: only settings with shared memory asked UCX
/// for SO_REUSEADDR. UCX 1.13 takes no such setting (README, "Connections heal"): skipped there.
#[test]
fn a_context_rank_restarted_at_its_port_listens_there_at_once_and_serves() {
    if kvlink::transport::ucx::resources::ucx_minor() < 22 {
        common::net::skip("UCX before 1.22 takes no SO_REUSEADDR for its listener");
        return;
    }
    let Some(net) = common::net::setup("rest") else {
        return;
    };
    // A fixed port, as a deployment names it: the namespace is the test's own.
    let at = format!("{}:7000", net.ip_b);
    let ctx_args = ["ctx", "--transport", "tcp", "--listen", at.as_str()];
    let mut ctx = in_ns(&net.b, &ctx_args);
    assert_eq!(ctx.expect_addr(), at);
    let mut gen = in_ns(
        &net.a,
        &["gen", "--transport", "tcp", "--to", &at, "--sizes", "4K,1M"],
    );
    gen.expect("CONNECTED");
    completes(&mut ctx, &mut gen, 1);
    println!("== a second context rank at {at} while the first lives (refused)");
    let mut twin = in_ns(&net.b, &ctx_args);
    let refused = twin.expect("ENGINE-ERROR");
    assert!(refused.contains("Transport"), "{refused}");
    assert_eq!(twin.child.wait().unwrap().code(), Some(3), "{refused}");
    println!("== the first killed, a new one at {at}");
    drop(ctx);
    let mut ctx = in_ns(&net.b, &ctx_args);
    assert_eq!(ctx.expect_addr(), at);
    completes(&mut ctx, &mut gen, 2);
}

/// A tcp engine whose listen address is on an interface its devices leave out is refused at
/// start (`InvalidArgument`, naming the interface). Before, it started: peers reached the
/// listener, and every connection then failed (`PeerLost`, at once on one host; at the
/// connect's deadline between two) because UCX had no tcp lane between the ends.
#[test]
fn a_listen_address_outside_the_transports_devices_is_refused_at_start() {
    use kvlink::connection::{Engine, EngineConfig};
    let engine = |setting: &str, listen: &str| {
        let (kind, devices) = TransportKind::parse_setting(setting).unwrap();
        let mut c = EngineConfig::new("ctx", 0, kind);
        c.net_devices = devices;
        c.listen = Some(listen.parse().unwrap());
        Engine::new(c)
    };
    // This host's first IPv4 interface besides loopback, from `ip`.
    let out = Command::new("ip")
        .args(["-4", "-o", "addr"])
        .output()
        .unwrap();
    let other = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|f| f.len() > 3 && f[1] != "lo")
        .map(|f| {
            (
                f[1].to_string(),
                f[3].split('/').next().unwrap().to_string(),
            )
        });
    assert!(engine("tcp@lo", "127.0.0.1:0").is_ok(), "on its device");
    let Some((dev, ip)) = other else {
        common::net::skip("no IPv4 interface besides loopback here");
        return;
    };
    assert!(engine(&format!("tcp@{dev}"), &format!("{ip}:0")).is_ok());
    assert!(engine("tcp@lo", "0.0.0.0:0").is_ok(), "the wildcard");
    for (setting, listen, on) in [
        ("tcp@lo".to_string(), format!("{ip}:0"), dev.as_str()),
        (format!("tcp@{dev}"), "127.0.0.1:0".to_string(), "lo"),
        (format!("tcp@^{dev}"), format!("{ip}:0"), dev.as_str()),
    ] {
        let e = engine(&setting, &listen).err().unwrap_or_else(|| {
            panic!("{setting} listening at {listen} started");
        });
        println!("{setting} at {listen}: {e}");
        assert_eq!(e.kind, ErrorKind::InvalidArgument, "{e}");
        assert!(e.message.contains(&format!("is on {on}")), "{e}");
    }
}
