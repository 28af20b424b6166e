//! Terminate error codes of RFC 5040, RFC 5041, RFC 5044 and RFC 6581,
//! declared once.
//!
//! A Terminate message (RFC 5040 section 4.8) names the error that ended the
//! stream with three fields at the start of its Terminate Control field:
//!
//! ```text
//!  0                   1                   2
//!  0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1 2 3
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! | Layer | EType |  Error Code   |Hdrct| ...
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! ```
//!
//! * Layer (4 bits): 0 RDMAP, 1 DDP, 2 LLP (MPA);
//! * EType (4 bits): the error type, whose meaning depends on the layer;
//! * Error Code (8 bits): the error, whose meaning depends on layer and type.
//!
//! The table below ([`TermError`]) is the single place where the values
//! appear. Names are those of the IANA "Remote Direct Data Placement (RDDP)"
//! registries created by RFC 6580 ("RDMAP Errors", "DDP Errors", "MPA
//! Errors"), which copy the RFC tables (RFC 5040 section 7.2 for RDMAP,
//! RFC 5041 section 7.2 for DDP, RFC 5044 and RFC 6581 for the LLP); the
//! values agree with Linux siw's `iwarp.h` (`term_elayer`, `rdmap_etype`,
//! `rdmap_ecode`, `ddp_etype`, `ddp_ecode`, `llp_etype`, `llp_ecode`).
//!
//! RFC 7306 (atomics, immediate data) registers no Terminate error codes:
//! the IANA RDMAP Errors registry, last updated after RFC 7306 was published,
//! lists only RFC 5040 entries. So the table has no RFC 7306 rows.
//!
//! Codes outside the table are still carried, unchanged, by [`TermCode`]
//! (the raw layer / type / code triple a Terminate message holds).

use core::fmt;

/// The layer that detected the error (the Terminate "Layer" nibble).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Layer {
    /// RDMAP (RFC 5040).
    Rdmap = 0,
    /// DDP (RFC 5041).
    Ddp = 1,
    /// The lower layer protocol: MPA over TCP (RFC 5044, RFC 6581).
    Llp = 2,
}

impl Layer {
    /// The layer with wire value `value`, if it is one of the three defined.
    pub const fn from_u8(value: u8) -> Option<Self> {
        match value {
            0 => Some(Self::Rdmap),
            1 => Some(Self::Ddp),
            2 => Some(Self::Llp),
            _ => None,
        }
    }

    /// The wire value (4 bits).
    pub const fn to_u8(self) -> u8 {
        self as u8
    }

    /// Short name: `"RDMAP"`, `"DDP"` or `"LLP"`.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Rdmap => "RDMAP",
            Self::Ddp => "DDP",
            Self::Llp => "LLP",
        }
    }
}

impl fmt::Display for Layer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An error type: a (layer, EType nibble) pair with its RFC name.
///
/// DDP EType 0x3 is "reserved for the use by the LLP" in RFC 5041 and has no
/// codes of its own; it is not a variant (a [`TermCode`] still carries it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorType {
    /// RDMAP 0x0: Local Catastrophic Error.
    RdmapLocalCatastrophic,
    /// RDMAP 0x1: Remote Protection Error.
    RdmapRemoteProtection,
    /// RDMAP 0x2: Remote Operation Error.
    RdmapRemoteOperation,
    /// DDP 0x0: Local Catastrophic.
    DdpLocalCatastrophic,
    /// DDP 0x1: Tagged Buffer Error.
    DdpTaggedBuffer,
    /// DDP 0x2: Untagged Buffer Error.
    DdpUntaggedBuffer,
    /// LLP 0x0: MPA Error.
    LlpMpa,
}

impl ErrorType {
    /// Every error type, in wire order.
    pub const ALL: &'static [ErrorType] = &[
        Self::RdmapLocalCatastrophic,
        Self::RdmapRemoteProtection,
        Self::RdmapRemoteOperation,
        Self::DdpLocalCatastrophic,
        Self::DdpTaggedBuffer,
        Self::DdpUntaggedBuffer,
        Self::LlpMpa,
    ];

    /// The layer this type belongs to.
    pub const fn layer(self) -> Layer {
        match self {
            Self::RdmapLocalCatastrophic
            | Self::RdmapRemoteProtection
            | Self::RdmapRemoteOperation => Layer::Rdmap,
            Self::DdpLocalCatastrophic | Self::DdpTaggedBuffer | Self::DdpUntaggedBuffer => {
                Layer::Ddp
            }
            Self::LlpMpa => Layer::Llp,
        }
    }

    /// The EType nibble.
    pub const fn etype(self) -> u8 {
        match self {
            Self::RdmapLocalCatastrophic | Self::DdpLocalCatastrophic | Self::LlpMpa => 0x0,
            Self::RdmapRemoteProtection | Self::DdpTaggedBuffer => 0x1,
            Self::RdmapRemoteOperation | Self::DdpUntaggedBuffer => 0x2,
        }
    }

    /// The RFC name of the error type.
    pub const fn name(self) -> &'static str {
        match self {
            Self::RdmapLocalCatastrophic => "Local Catastrophic Error",
            Self::RdmapRemoteProtection => "Remote Protection Error",
            Self::RdmapRemoteOperation => "Remote Operation Error",
            Self::DdpLocalCatastrophic => "Local Catastrophic",
            Self::DdpTaggedBuffer => "Tagged Buffer Error",
            Self::DdpUntaggedBuffer => "Untagged Buffer Error",
            Self::LlpMpa => "MPA Error",
        }
    }

    /// The error type with this layer and EType nibble, if defined.
    pub const fn from_parts(layer: u8, etype: u8) -> Option<Self> {
        match (layer, etype) {
            (0, 0x0) => Some(Self::RdmapLocalCatastrophic),
            (0, 0x1) => Some(Self::RdmapRemoteProtection),
            (0, 0x2) => Some(Self::RdmapRemoteOperation),
            (1, 0x0) => Some(Self::DdpLocalCatastrophic),
            (1, 0x1) => Some(Self::DdpTaggedBuffer),
            (1, 0x2) => Some(Self::DdpUntaggedBuffer),
            (2, 0x0) => Some(Self::LlpMpa),
            _ => None,
        }
    }
}

/// Declares [`TermError`] and its accessors from one table, so each value
/// and name is written exactly once.
macro_rules! term_errors {
    (
        $(
            $(#[$doc:meta])*
            $variant:ident = ($etype:ident, $ecode:literal, $rfc:literal, $name:literal);
        )*
    ) => {
        /// A Terminate error with a defined meaning: one row of the table of
        /// RFC 5040, RFC 5041, RFC 5044 and RFC 6581 error codes.
        ///
        /// Use [`TermCode`] for the raw values a Terminate message carries,
        /// which may be outside this table.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum TermError {
            $(
                $(#[$doc])*
                $variant,
            )*
        }

        impl TermError {
            /// Every row of the table, in wire order.
            pub const ALL: &'static [TermError] = &[$(TermError::$variant),*];

            /// The error type (layer and EType) of this error.
            pub const fn error_type(self) -> ErrorType {
                match self {
                    $(TermError::$variant => ErrorType::$etype,)*
                }
            }

            /// The Error Code byte.
            pub const fn ecode(self) -> u8 {
                match self {
                    $(TermError::$variant => $ecode,)*
                }
            }

            /// The number of the RFC that defines this error.
            pub const fn rfc(self) -> u16 {
                match self {
                    $(TermError::$variant => $rfc,)*
                }
            }

            /// The RFC name of the error code (without the error type name;
            /// see [`TermError::error_type`] for that).
            pub const fn name(self) -> &'static str {
                match self {
                    $(TermError::$variant => $name,)*
                }
            }
        }
    };
}

term_errors! {
    // ---- RDMAP (layer 0x0), RFC 5040 section 7.2 ----
    /// 0x0/0x0/any: Local Catastrophic Error. The RFC gives no codes for
    /// this type (IANA: "ALL"); every code value maps to this row and it is
    /// emitted as 0x00 (Linux siw sends 0xff; see [`TermCode`] to send that).
    RdmapLocalCatastrophic = (RdmapLocalCatastrophic, 0x00, 5040, "Local Catastrophic Error");
    /// 0x0/0x1/0x00: Invalid Steering Tag.
    RdmapInvalidStag = (RdmapRemoteProtection, 0x00, 5040, "Invalid Steering Tag");
    /// 0x0/0x1/0x01: Base or bounds violation.
    RdmapBaseOrBounds = (RdmapRemoteProtection, 0x01, 5040, "Base or bounds violation");
    /// 0x0/0x1/0x02: Access rights violation.
    RdmapAccessRights = (RdmapRemoteProtection, 0x02, 5040, "Access rights violation");
    /// 0x0/0x1/0x03: Steering Tag not associated with RDMAP Stream.
    RdmapStagNotAssociated =
        (RdmapRemoteProtection, 0x03, 5040, "Steering Tag not associated with RDMAP Stream");
    /// 0x0/0x1/0x04: Tagged Offset wrap.
    RdmapToWrap = (RdmapRemoteProtection, 0x04, 5040, "Tagged Offset wrap");
    /// 0x0/0x1/0x09: Steering Tag cannot be invalidated.
    RdmapProtectionCannotInvalidate =
        (RdmapRemoteProtection, 0x09, 5040, "Steering Tag cannot be invalidated");
    /// 0x0/0x1/0xff: Unspecified Error.
    RdmapProtectionUnspecified = (RdmapRemoteProtection, 0xff, 5040, "Unspecified Error");
    /// 0x0/0x2/0x05: Invalid RDMAP version.
    RdmapInvalidVersion = (RdmapRemoteOperation, 0x05, 5040, "Invalid RDMAP version");
    /// 0x0/0x2/0x06: Unexpected OpCode.
    RdmapUnexpectedOpcode = (RdmapRemoteOperation, 0x06, 5040, "Unexpected OpCode");
    /// 0x0/0x2/0x07: Catastrophic error, localized to RDMAP Stream.
    RdmapCatastrophicStream =
        (RdmapRemoteOperation, 0x07, 5040, "Catastrophic error, localized to RDMAP Stream");
    /// 0x0/0x2/0x08: Catastrophic error, global.
    RdmapCatastrophicGlobal = (RdmapRemoteOperation, 0x08, 5040, "Catastrophic error, global");
    /// 0x0/0x2/0x09: Steering Tag cannot be Invalidated.
    RdmapOperationCannotInvalidate =
        (RdmapRemoteOperation, 0x09, 5040, "Steering Tag cannot be Invalidated");
    /// 0x0/0x2/0xff: Unspecified Error.
    RdmapOperationUnspecified = (RdmapRemoteOperation, 0xff, 5040, "Unspecified Error");

    // ---- DDP (layer 0x1), RFC 5041 section 7.2 ----
    /// 0x1/0x0/0x00: Local Catastrophic.
    DdpLocalCatastrophic = (DdpLocalCatastrophic, 0x00, 5041, "Local Catastrophic");
    /// 0x1/0x1/0x00: Invalid Steering Tag.
    DdpTaggedInvalidStag = (DdpTaggedBuffer, 0x00, 5041, "Invalid Steering Tag");
    /// 0x1/0x1/0x01: Base or bounds violation.
    DdpTaggedBaseOrBounds = (DdpTaggedBuffer, 0x01, 5041, "Base or bounds violation");
    /// 0x1/0x1/0x02: Steering Tag not associated with DDP Stream.
    DdpTaggedStagNotAssociated =
        (DdpTaggedBuffer, 0x02, 5041, "Steering Tag not associated with DDP Stream");
    /// 0x1/0x1/0x03: Tagged Offset wrap.
    DdpTaggedToWrap = (DdpTaggedBuffer, 0x03, 5041, "Tagged Offset wrap");
    /// 0x1/0x1/0x04: Invalid DDP version.
    DdpTaggedInvalidVersion = (DdpTaggedBuffer, 0x04, 5041, "Invalid DDP version");
    /// 0x1/0x2/0x01: Invalid Queue Number.
    DdpUntaggedInvalidQn = (DdpUntaggedBuffer, 0x01, 5041, "Invalid Queue Number");
    /// 0x1/0x2/0x02: Invalid Message Sequence Number - no buffer available.
    /// (A Send with no posted receive.)
    DdpUntaggedNoBuffer = (
        DdpUntaggedBuffer,
        0x02,
        5041,
        "Invalid Message Sequence Number - no buffer available"
    );
    /// 0x1/0x2/0x03: Invalid Message Sequence Number - MSN range is not valid.
    DdpUntaggedMsnRange = (
        DdpUntaggedBuffer,
        0x03,
        5041,
        "Invalid Message Sequence Number - MSN range is not valid"
    );
    /// 0x1/0x2/0x04: Invalid Message Offset.
    DdpUntaggedInvalidMo = (DdpUntaggedBuffer, 0x04, 5041, "Invalid Message Offset");
    /// 0x1/0x2/0x05: DDP Message too long for available buffer.
    DdpUntaggedMessageTooLong =
        (DdpUntaggedBuffer, 0x05, 5041, "DDP Message too long for available buffer");
    /// 0x1/0x2/0x06: Invalid DDP version.
    DdpUntaggedInvalidVersion = (DdpUntaggedBuffer, 0x06, 5041, "Invalid DDP version");

    // ---- LLP / MPA (layer 0x2), RFC 5044 and RFC 6581 ----
    /// 0x2/0x0/0x01: TCP connection closed, terminated or lost.
    MpaConnectionLost = (LlpMpa, 0x01, 5044, "TCP connection closed, terminated or lost");
    /// 0x2/0x0/0x02: MPA CRC Error.
    MpaCrcError = (LlpMpa, 0x02, 5044, "MPA CRC Error");
    /// 0x2/0x0/0x03: MPA Marker and ULPDU Length field mismatch.
    MpaMarkerMismatch = (LlpMpa, 0x03, 5044, "MPA Marker and ULPDU Length field mismatch");
    /// 0x2/0x0/0x04: Invalid MPA Request Frame or MPA Response Frame.
    MpaInvalidRequestReply =
        (LlpMpa, 0x04, 5044, "Invalid MPA Request Frame or MPA Response Frame");
    /// 0x2/0x0/0x05: Local Catastrophic Error (enhanced connection
    /// establishment only).
    MpaLocalCatastrophic = (LlpMpa, 0x05, 6581, "Local Catastrophic Error");
    /// 0x2/0x0/0x06: Insufficient IRD Resources (enhanced connection
    /// establishment only).
    MpaInsufficientIrd = (LlpMpa, 0x06, 6581, "Insufficient IRD Resources");
    /// 0x2/0x0/0x07: No Matching RTR Option (enhanced connection
    /// establishment only).
    MpaNoMatchingRtr = (LlpMpa, 0x07, 6581, "No Matching RTR Option");
}

impl TermError {
    /// The layer that reports this error.
    pub const fn layer(self) -> Layer {
        self.error_type().layer()
    }

    /// The EType nibble.
    pub const fn etype(self) -> u8 {
        self.error_type().etype()
    }

    /// The table row for these wire values, or `None` if the combination is
    /// not defined (a [`TermCode`] still carries it).
    ///
    /// RDMAP Local Catastrophic Error (0x0/0x0) matches every error code.
    pub fn from_parts(layer: u8, etype: u8, ecode: u8) -> Option<Self> {
        if (layer, etype) == (0, 0) {
            return Some(Self::RdmapLocalCatastrophic);
        }
        Self::ALL
            .iter()
            .copied()
            .find(|e| e.layer().to_u8() == layer && e.etype() == etype && e.ecode() == ecode)
    }

    /// The raw wire values of this error.
    pub const fn code(self) -> TermCode {
        TermCode {
            layer: self.layer().to_u8(),
            etype: self.etype(),
            ecode: self.ecode(),
        }
    }
}

impl fmt::Display for TermError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.code().fmt(f)
    }
}

/// The raw Layer / EType / Error Code triple of a Terminate message.
///
/// Any combination of a 4-bit layer, a 4-bit type and an 8-bit code is
/// representable, so a Terminate with an unknown code still decodes and
/// re-encodes unchanged; [`TermCode::known`] looks the triple up in the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TermCode {
    layer: u8,
    etype: u8,
    ecode: u8,
}

impl TermCode {
    /// A code from raw values, or `None` if `layer` or `etype` does not fit
    /// in 4 bits.
    pub const fn new(layer: u8, etype: u8, ecode: u8) -> Option<Self> {
        if layer > 0xf || etype > 0xf {
            return None;
        }
        Some(Self {
            layer,
            etype,
            ecode,
        })
    }

    /// The code from the first two bytes of the Terminate Control field
    /// (`Layer << 4 | EType`, `Error Code`).
    pub const fn from_bytes(bytes: [u8; 2]) -> Self {
        Self {
            layer: bytes[0] >> 4,
            etype: bytes[0] & 0x0f,
            ecode: bytes[1],
        }
    }

    /// The first two bytes of the Terminate Control field.
    pub const fn to_bytes(self) -> [u8; 2] {
        [(self.layer << 4) | self.etype, self.ecode]
    }

    /// The Layer nibble.
    pub const fn layer_raw(self) -> u8 {
        self.layer
    }

    /// The layer, if the nibble is a defined one.
    pub const fn layer(self) -> Option<Layer> {
        Layer::from_u8(self.layer)
    }

    /// The EType nibble.
    pub const fn etype(self) -> u8 {
        self.etype
    }

    /// The Error Code byte.
    pub const fn ecode(self) -> u8 {
        self.ecode
    }

    /// The error type, if (layer, EType) is defined.
    pub const fn error_type(self) -> Option<ErrorType> {
        ErrorType::from_parts(self.layer, self.etype)
    }

    /// The table row for this code, if defined.
    pub fn known(self) -> Option<TermError> {
        TermError::from_parts(self.layer, self.etype, self.ecode)
    }
}

impl From<TermError> for TermCode {
    fn from(e: TermError) -> Self {
        e.code()
    }
}

impl fmt::Display for TermCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.known() {
            Some(e) => write!(
                f,
                "{} {} / {} ({:#x}/{:#x}/{:#04x}, RFC {})",
                e.layer(),
                e.error_type().name(),
                e.name(),
                self.layer,
                self.etype,
                self.ecode,
                e.rfc()
            ),
            None => write!(
                f,
                "unknown Terminate error {:#x}/{:#x}/{:#04x}",
                self.layer, self.etype, self.ecode
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    /// (layer, etype, ecode) of every row, written out independently of the
    /// table, as in Linux siw's `iwarp.h` enums.
    const SIW_VALUES: &[(TermError, u8, u8, u8)] = &[
        (TermError::RdmapInvalidStag, 0, 1, 0x00),
        (TermError::RdmapBaseOrBounds, 0, 1, 0x01),
        (TermError::RdmapAccessRights, 0, 1, 0x02),
        (TermError::RdmapStagNotAssociated, 0, 1, 0x03),
        (TermError::RdmapToWrap, 0, 1, 0x04),
        (TermError::RdmapInvalidVersion, 0, 2, 0x05),
        (TermError::RdmapUnexpectedOpcode, 0, 2, 0x06),
        (TermError::RdmapCatastrophicStream, 0, 2, 0x07),
        (TermError::RdmapCatastrophicGlobal, 0, 2, 0x08),
        (TermError::RdmapOperationCannotInvalidate, 0, 2, 0x09),
        (TermError::RdmapOperationUnspecified, 0, 2, 0xff),
        (TermError::DdpLocalCatastrophic, 1, 0, 0x00),
        (TermError::DdpTaggedInvalidStag, 1, 1, 0x00),
        (TermError::DdpTaggedBaseOrBounds, 1, 1, 0x01),
        (TermError::DdpTaggedStagNotAssociated, 1, 1, 0x02),
        (TermError::DdpTaggedToWrap, 1, 1, 0x03),
        (TermError::DdpTaggedInvalidVersion, 1, 1, 0x04),
        (TermError::DdpUntaggedInvalidQn, 1, 2, 0x01),
        (TermError::DdpUntaggedNoBuffer, 1, 2, 0x02),
        (TermError::DdpUntaggedMsnRange, 1, 2, 0x03),
        (TermError::DdpUntaggedInvalidMo, 1, 2, 0x04),
        (TermError::DdpUntaggedMessageTooLong, 1, 2, 0x05),
        (TermError::DdpUntaggedInvalidVersion, 1, 2, 0x06),
        (TermError::MpaConnectionLost, 2, 0, 0x01),
        (TermError::MpaCrcError, 2, 0, 0x02),
        (TermError::MpaMarkerMismatch, 2, 0, 0x03),
        (TermError::MpaInvalidRequestReply, 2, 0, 0x04),
        (TermError::MpaLocalCatastrophic, 2, 0, 0x05),
        (TermError::MpaInsufficientIrd, 2, 0, 0x06),
        (TermError::MpaNoMatchingRtr, 2, 0, 0x07),
    ];

    #[test]
    fn values_match_siw() {
        for &(e, layer, etype, ecode) in SIW_VALUES {
            assert_eq!(
                (e.layer().to_u8(), e.etype(), e.ecode()),
                (layer, etype, ecode),
                "{e:?}"
            );
            assert_eq!(TermError::from_parts(layer, etype, ecode), Some(e));
        }
    }

    #[test]
    fn table_rows_are_unique_and_round_trip() {
        let mut seen = HashSet::new();
        for &e in TermError::ALL {
            let c = e.code();
            assert!(seen.insert(c), "duplicate {c:?}");
            assert_eq!(c.known(), Some(e));
            assert_eq!(TermCode::from_bytes(c.to_bytes()), c);
            assert!(!e.name().is_empty());
            assert!([5040, 5041, 5044, 6581].contains(&e.rfc()));
            assert_eq!(
                ErrorType::from_parts(c.layer_raw(), c.etype()),
                Some(e.error_type())
            );
        }
        assert_eq!(TermError::ALL.len(), 33);
    }

    #[test]
    fn local_catastrophic_matches_any_code() {
        // siw sends 0/0/0xff when a QP is moved to TERMINATE.
        assert_eq!(
            TermError::from_parts(0, 0, 0xff),
            Some(TermError::RdmapLocalCatastrophic)
        );
        let c = TermCode::new(0, 0, 0xff).unwrap();
        assert_eq!(c.known(), Some(TermError::RdmapLocalCatastrophic));
        assert_eq!(c.ecode(), 0xff);
        assert!(c.to_string().contains("0x0/0x0/0xff"), "{c}");
    }

    #[test]
    fn unknown_codes_are_kept() {
        assert_eq!(TermError::from_parts(1, 2, 0x07), None);
        assert_eq!(TermError::from_parts(3, 0, 0x00), None);
        assert_eq!(TermError::from_parts(1, 3, 0x00), None);
        let c = TermCode::new(0xf, 0xe, 0x42).unwrap();
        assert_eq!(c.known(), None);
        assert_eq!(c.layer(), None);
        assert_eq!(c.to_bytes(), [0xfe, 0x42]);
        assert!(c.to_string().starts_with("unknown"));
        assert_eq!(TermCode::new(0x10, 0, 0), None);
        assert_eq!(TermCode::new(0, 0x10, 0), None);
    }

    #[test]
    fn display_names_the_row() {
        let s = TermError::DdpUntaggedNoBuffer.to_string();
        assert!(s.contains("Untagged Buffer Error"), "{s}");
        assert!(s.contains("no buffer available"), "{s}");
        assert!(s.contains("RFC 5041"), "{s}");
    }

    proptest! {
        #[test]
        fn raw_codes_round_trip(b0 in any::<u8>(), b1 in any::<u8>()) {
            let c = TermCode::from_bytes([b0, b1]);
            prop_assert_eq!(c.to_bytes(), [b0, b1]);
            if let Some(e) = c.known() {
                prop_assert_eq!(e.layer().to_u8(), c.layer_raw());
                prop_assert_eq!(e.etype(), c.etype());
                if e != TermError::RdmapLocalCatastrophic {
                    prop_assert_eq!(e.ecode(), c.ecode());
                }
            }
        }
    }
}
