//! Socket addresses as Envoy and the backend write them: `ip:port`, `[ip6]:port`, or an IP
//! alone. One parser for the filter's peer and listener addresses and for comparing a fleet
//! endpoint with the address its poll reached.

use std::net::IpAddr;

/// The IP and port of `addr`, the IP canonical (IPv4-mapped IPv6 as IPv4). `None`: not an IP
/// address (a host name, garbage).
pub fn parse(addr: &str) -> Option<(IpAddr, Option<u16>)> {
    if let Ok(ip) = addr.parse::<IpAddr>() {
        return Some((ip.to_canonical(), None));
    }
    let (ip, port) = addr.rsplit_once(':')?;
    let ip = ip
        .strip_prefix('[')
        .and_then(|i| i.strip_suffix(']'))
        .unwrap_or(ip);
    Some((
        ip.parse::<IpAddr>().ok()?.to_canonical(),
        Some(port.parse().ok()?),
    ))
}

/// The IP of `addr` (see [`parse`]).
pub fn ip(addr: &str) -> Option<IpAddr> {
    parse(addr).map(|(ip, _)| ip)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_as_envoy_writes_them() {
        let v4: IpAddr = "10.0.0.5".parse().unwrap();
        assert_eq!(parse("10.0.0.5:8000"), Some((v4, Some(8000))));
        assert_eq!(parse("[::ffff:10.0.0.5]:8000"), Some((v4, Some(8000))));
        assert_eq!(parse("10.0.0.5"), Some((v4, None)));
        assert_eq!(ip("[::1]:40000"), Some("::1".parse().unwrap()));
        assert_eq!(ip("::1"), Some("::1".parse().unwrap()));
        for bad in ["", "backend:8000", "10.0.0.5:http", "[::1", "1.2.3.4:99999"] {
            assert_eq!(parse(bad), None, "{bad}");
        }
    }
}
