//! Agent configuration and its validation.
use crate::error::{Error, Result};
use std::net::SocketAddr;

/// Parses an `ip:port` listen or connect address (IPv4 or `[IPv6]:port`).
pub fn parse_listen_address(addr: &str) -> Result<SocketAddr> {
    addr.trim()
        .parse::<SocketAddr>()
        .map_err(|e| Error::invalid(format!("'{addr}' is not an ip:port address: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    #[test]
    fn addresses() {
        assert_eq!(parse_listen_address("127.0.0.1:5000").unwrap().port(), 5000);
        assert_eq!(parse_listen_address("[::1]:0").unwrap().port(), 0);
        for bad in ["", "localhost", "127.0.0.1", "1.2.3.4:99999", "x:1"] {
            assert_eq!(
                parse_listen_address(bad).unwrap_err().kind,
                ErrorKind::InvalidArgument
            );
        }
    }
}
