//! Connection qualifiers and TCP ports.
//!
//! softrdma carries DAT connections over TCP, so a connection qualifier
//! names a TCP port of the IA's address:
//!
//! ```text
//! port = (conn_qual + base) mod 65536
//! ```
//!
//! with `base` 0 by default, so the qualifiers the DAPL test programs use
//! (dtest/dtestsrq/dtestcm 45248, dapltest 62000 + n) are their own ports.
//! A qualifier whose port would be 0 cannot be listened on or connected
//! to. A listener's port maps back with [`conn_qual_of`].

/// The TCP port of `conn_qual` with this `base`, or `None` if it is 0.
pub fn port_of(conn_qual: u64, base: u16) -> Option<u16> {
    let port = (conn_qual.wrapping_add(u64::from(base)) % 65536) as u16;
    (port != 0).then_some(port)
}

/// The connection qualifier a `port` stands for with this `base` (the
/// smallest one, in `0..65536`).
pub fn conn_qual_of(port: u16, base: u16) -> u64 {
    u64::from(port.wrapping_sub(base))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_program_qualifiers_are_their_ports() {
        assert_eq!(port_of(45248, 0), Some(45248));
        assert_eq!(port_of(62000, 0), Some(62000));
        assert_eq!(port_of(62000 + 65536, 0), Some(62000));
        assert_eq!(port_of(0, 0), None);
        assert_eq!(port_of(65536, 0), None);
        assert_eq!(port_of(100, 1000), Some(1100));
        assert_eq!(port_of(65535, 1), None);
    }

    #[test]
    fn ports_map_back() {
        for base in [0u16, 1000, 65535] {
            for q in [1u64, 45248, 62000, 65535] {
                if let Some(p) = port_of(q, base) {
                    assert_eq!(conn_qual_of(p, base), q % 65536);
                }
            }
        }
    }
}
