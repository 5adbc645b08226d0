//! Agent configuration and its validation.
use crate::error::{Error, Result};
use std::net::SocketAddr;

/// Parses an IPv4 `ip:port` listen or connect address. `[IPv6]:port` is refused with a reason:
/// UCX's tcp transport corrupts memory on IPv6 connections (`Agent::new` and `Agent::connect_by`
/// refuse one too).
pub fn parse_listen_address(addr: &str) -> Result<SocketAddr> {
    let a = addr
        .trim()
        .parse::<SocketAddr>()
        .map_err(|e| Error::invalid(format!("'{addr}' is not an ip:port address: {e}")))?;
    crate::transport::ucx::ipv4_only(a)?;
    Ok(a)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    #[test]
    fn addresses() {
        assert_eq!(parse_listen_address("127.0.0.1:5000").unwrap().port(), 5000);
        assert_eq!(parse_listen_address(" 0.0.0.0:0 ").unwrap().port(), 0);
        let v6 = parse_listen_address("[::1]:0").unwrap_err();
        assert_eq!(v6.kind, ErrorKind::InvalidArgument);
        assert!(v6.message.contains("IPv6"), "{}", v6.message);
        for bad in [
            "",
            "localhost",
            "127.0.0.1",
            "1.2.3.4:99999",
            "x:1",
            "[::1]:0",
        ] {
            assert_eq!(
                parse_listen_address(bad).unwrap_err().kind,
                ErrorKind::InvalidArgument
            );
        }
    }
}
