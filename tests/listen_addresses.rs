//! Listen and connect addresses as an operator writes them, over real UCX tcp. An IPv6 one is
//! refused with `InvalidArgument`: before it was, a connection through an IPv6 listener
//! (`[::1]:0`) overflowed a heap block in UCX's tcp transport (`uct_tcp_ep_set_dest_addr`,
//! 1.13 and 1.22) and the process aborted in malloc ("double free or corruption").
use kvlink::transport::{Agent, AgentOptions, TransportKind};
use kvlink::{ErrorKind, Outcome};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

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
