//! `DAT_RETURN`: a class (bits 31–30), a type (bits 29–16) and a subtype
//! (bits 15–0), as in `dat_error.h`. [`DatError`] converts to and from the
//! 32-bit value without loss.

macro_rules! values {
    ($(#[$m:meta])* $name:ident : $repr:ty { $($(#[$vm:meta])* $v:ident = $n:expr),* $(,)? }) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[repr($repr)]
        pub enum $name { $($(#[$vm])* $v = $n),* }
        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$v),*];
            /// The value with this number, if it is one.
            pub fn from_raw(raw: $repr) -> Option<$name> {
                $name::ALL.iter().copied().find(|v| *v as $repr == raw)
            }
            /// The C name of the value.
            pub const fn name(self) -> &'static str {
                match self { $($name::$v => stringify!($v)),* }
            }
        }
    };
}

values! {
    /// `DAT_RETURN_TYPE` (the type field, bits 29–16).
    ErrorType: u16 {
        /// `DAT_SUCCESS`.
        Success = 0x0000,
        /// `DAT_ABORT`: the IA was closed or the EVD destroyed.
        Abort = 0x0001,
        /// `DAT_CONN_QUAL_IN_USE`.
        ConnQualInUse = 0x0002,
        /// `DAT_INSUFFICIENT_RESOURCES`.
        InsufficientResources = 0x0003,
        /// `DAT_INTERNAL_ERROR`.
        InternalError = 0x0004,
        /// `DAT_INVALID_HANDLE`.
        InvalidHandle = 0x0005,
        /// `DAT_INVALID_PARAMETER`.
        InvalidParameter = 0x0006,
        /// `DAT_INVALID_STATE`.
        InvalidState = 0x0007,
        /// `DAT_LENGTH_ERROR`.
        LengthError = 0x0008,
        /// `DAT_MODEL_NOT_SUPPORTED`.
        ModelNotSupported = 0x0009,
        /// `DAT_PROVIDER_NOT_FOUND`.
        ProviderNotFound = 0x000A,
        /// `DAT_PRIVILEGES_VIOLATION`.
        PrivilegesViolation = 0x000B,
        /// `DAT_PROTECTION_VIOLATION`.
        ProtectionViolation = 0x000C,
        /// `DAT_QUEUE_EMPTY`.
        QueueEmpty = 0x000D,
        /// `DAT_QUEUE_FULL`.
        QueueFull = 0x000E,
        /// `DAT_TIMEOUT_EXPIRED`.
        TimeoutExpired = 0x000F,
        /// `DAT_PROVIDER_ALREADY_REGISTERED`.
        ProviderAlreadyRegistered = 0x0010,
        /// `DAT_PROVIDER_IN_USE`.
        ProviderInUse = 0x0011,
        /// `DAT_INTERRUPTED_CALL`.
        InterruptedCall = 0x0013,
        /// `DAT_CONN_QUAL_UNAVAILABLE`.
        ConnQualUnavailable = 0x0014,
        /// `DAT_PORT_IN_USE`.
        PortInUse = 0x0016,
        /// `DAT_COMM_NOT_SUPPORTED`.
        CommNotSupported = 0x0017,
        /// `DAT_NOT_IMPLEMENTED`.
        NotImplemented = 0x3FFF,
    }
}

values! {
    /// `DAT_RETURN_SUBTYPE` (bits 15–0).
    Subtype: u16 {
        /// `DAT_NO_SUBTYPE`.
        None = 0, /// `DAT_SUB_INTERRUPTED`.
        Interrupted = 1, /// `DAT_RESOURCE_MEMORY`.
        ResourceMemory = 2, /// `DAT_RESOURCE_DEVICE`.
        ResourceDevice = 3, /// `DAT_RESOURCE_TEP`.
        ResourceTep = 4, /// `DAT_RESOURCE_TEVD`.
        ResourceTevd = 5, /// `DAT_RESOURCE_PROTECTION_DOMAIN`.
        ResourceProtectionDomain = 6, /// `DAT_RESOURCE_MEMORY_REGION`.
        ResourceMemoryRegion = 7, /// `DAT_RESOURCE_ERROR_HANDLER`.
        ResourceErrorHandler = 8, /// `DAT_RESOURCE_CREDITS`.
        ResourceCredits = 9, /// `DAT_RESOURCE_SRQ`.
        ResourceSrq = 10, /// `DAT_INVALID_HANDLE_IA`.
        HandleIa = 11, /// `DAT_INVALID_HANDLE_EP`.
        HandleEp = 12, /// `DAT_INVALID_HANDLE_LMR`.
        HandleLmr = 13, /// `DAT_INVALID_HANDLE_RMR`.
        HandleRmr = 14, /// `DAT_INVALID_HANDLE_PZ`.
        HandlePz = 15, /// `DAT_INVALID_HANDLE_PSP`.
        HandlePsp = 16, /// `DAT_INVALID_HANDLE_RSP`.
        HandleRsp = 17, /// `DAT_INVALID_HANDLE_CR`.
        HandleCr = 18, /// `DAT_INVALID_HANDLE_CNO`.
        HandleCno = 19, /// `DAT_INVALID_HANDLE_EVD_CR`.
        HandleEvdCr = 20, /// `DAT_INVALID_HANDLE_EVD_REQUEST`.
        HandleEvdRequest = 21, /// `DAT_INVALID_HANDLE_EVD_RECV`.
        HandleEvdRecv = 22, /// `DAT_INVALID_HANDLE_EVD_CONN`.
        HandleEvdConn = 23, /// `DAT_INVALID_HANDLE_EVD_ASYNC`.
        HandleEvdAsync = 24, /// `DAT_INVALID_HANDLE_SRQ`.
        HandleSrq = 25, /// `DAT_INVALID_HANDLE_CSP`.
        HandleCsp = 26, /// `DAT_INVALID_HANDLE1`.
        Handle1 = 27, /// `DAT_INVALID_HANDLE2`.
        Handle2 = 28, /// `DAT_INVALID_HANDLE3`.
        Handle3 = 29, /// `DAT_INVALID_HANDLE4`.
        Handle4 = 30, /// `DAT_INVALID_HANDLE5`.
        Handle5 = 31, /// `DAT_INVALID_HANDLE6`.
        Handle6 = 32, /// `DAT_INVALID_HANDLE7`.
        Handle7 = 33, /// `DAT_INVALID_HANDLE8`.
        Handle8 = 34, /// `DAT_INVALID_HANDLE9`.
        Handle9 = 35, /// `DAT_INVALID_HANDLE10`.
        Handle10 = 36, /// `DAT_INVALID_ARG1`.
        Arg1 = 37, /// `DAT_INVALID_ARG2`.
        Arg2 = 38, /// `DAT_INVALID_ARG3`.
        Arg3 = 39, /// `DAT_INVALID_ARG4`.
        Arg4 = 40, /// `DAT_INVALID_ARG5`.
        Arg5 = 41, /// `DAT_INVALID_ARG6`.
        Arg6 = 42, /// `DAT_INVALID_ARG7`.
        Arg7 = 43, /// `DAT_INVALID_ARG8`.
        Arg8 = 44, /// `DAT_INVALID_ARG9`.
        Arg9 = 45, /// `DAT_INVALID_ARG10`.
        Arg10 = 46, /// `DAT_INVALID_STATE_EP_UNCONNECTED`.
        EpUnconnected = 47, /// `DAT_INVALID_STATE_EP_ACTCONNPENDING`.
        EpActConnPending = 48, /// `DAT_INVALID_STATE_EP_PASSCONNPENDING`.
        EpPassConnPending = 49, /// `DAT_INVALID_STATE_EP_TENTCONNPENDING`.
        EpTentConnPending = 50, /// `DAT_INVALID_STATE_EP_CONNECTED`.
        EpConnected = 51, /// `DAT_INVALID_STATE_EP_DISCONNECTED`.
        EpDisconnected = 52, /// `DAT_INVALID_STATE_EP_RESERVED`.
        EpReserved = 53, /// `DAT_INVALID_STATE_EP_COMPLPENDING`.
        EpComplPending = 54, /// `DAT_INVALID_STATE_EP_DISCPENDING`.
        EpDiscPending = 55, /// `DAT_INVALID_STATE_EP_PROVIDERCONTROL`.
        EpProviderControl = 56, /// `DAT_INVALID_STATE_EP_NOTREADY`.
        EpNotReady = 57, /// `DAT_INVALID_STATE_EP_RECV_WATERMARK`.
        EpRecvWatermark = 58, /// `DAT_INVALID_STATE_EP_PZ`.
        EpPz = 59, /// `DAT_INVALID_STATE_EP_EVD_REQUEST`.
        EpEvdRequest = 60, /// `DAT_INVALID_STATE_EP_EVD_RECV`.
        EpEvdRecv = 61, /// `DAT_INVALID_STATE_EP_EVD_CONNECT`.
        EpEvdConnect = 62, /// `DAT_INVALID_STATE_EP_UNCONFIGURED`.
        EpUnconfigured = 63, /// `DAT_INVALID_STATE_EP_UNCONFRESERVED`.
        EpUnconfReserved = 64, /// `DAT_INVALID_STATE_EP_UNCONFPASSIVE`.
        EpUnconfPassive = 65, /// `DAT_INVALID_STATE_EP_UNCONFTENTATIVE`.
        EpUnconfTentative = 66, /// `DAT_INVALID_STATE_CNO_IN_USE`.
        CnoInUse = 67, /// `DAT_INVALID_STATE_CNO_DEAD`.
        CnoDead = 68, /// `DAT_INVALID_STATE_EVD_OPEN`.
        EvdOpen = 69, /// `DAT_INVALID_STATE_EVD_ENABLED`.
        EvdEnabled = 70, /// `DAT_INVALID_STATE_EVD_DISABLED`.
        EvdDisabled = 71, /// `DAT_INVALID_STATE_EVD_WAITABLE`.
        EvdWaitable = 72, /// `DAT_INVALID_STATE_EVD_UNWAITABLE`.
        EvdUnwaitable = 73, /// `DAT_INVALID_STATE_EVD_IN_USE`.
        EvdInUse = 74, /// `DAT_INVALID_STATE_EVD_CONFIG_NOTIFY`.
        EvdConfigNotify = 75, /// `DAT_INVALID_STATE_EVD_CONFIG_SOLICITED`.
        EvdConfigSolicited = 76, /// `DAT_INVALID_STATE_EVD_CONFIG_THRESHOLD`.
        EvdConfigThreshold = 77, /// `DAT_INVALID_STATE_EVD_WAITER`.
        EvdWaiter = 78, /// `DAT_INVALID_STATE_EVD_ASYNC`.
        EvdAsync = 79, /// `DAT_INVALID_STATE_IA_IN_USE`.
        IaInUse = 80, /// `DAT_INVALID_STATE_LMR_IN_USE`.
        LmrInUse = 81, /// `DAT_INVALID_STATE_LMR_FREE`.
        LmrFree = 82, /// `DAT_INVALID_STATE_PZ_IN_USE`.
        PzInUse = 83, /// `DAT_INVALID_STATE_PZ_FREE`.
        PzFree = 84, /// `DAT_INVALID_STATE_SRQ_OPERATIONAL`.
        SrqOperational = 85, /// `DAT_INVALID_STATE_SRQ_ERROR`.
        SrqError = 86, /// `DAT_INVALID_STATE_SRQ_IN_USE`.
        SrqInUse = 87, /// `DAT_INVALID_STATE_SRQ_SHUTDOWN`.
        SrqShutdown = 88, /// `DAT_PRIVILEGES_READ`.
        PrivilegesRead = 89, /// `DAT_PRIVILEGES_WRITE`.
        PrivilegesWrite = 90, /// `DAT_PRIVILEGES_RDMA_READ`.
        PrivilegesRdmaRead = 91, /// `DAT_PRIVILEGES_RDMA_WRITE`.
        PrivilegesRdmaWrite = 92, /// `DAT_PROTECTION_READ`.
        ProtectionRead = 93, /// `DAT_PROTECTION_WRITE`.
        ProtectionWrite = 94, /// `DAT_PROTECTION_RDMA_READ`.
        ProtectionRdmaRead = 95, /// `DAT_PROTECTION_RDMA_WRITE`.
        ProtectionRdmaWrite = 96, /// `DAT_INVALID_ADDRESS_UNSUPPORTED`.
        AddressUnsupported = 97, /// `DAT_INVALID_ADDRESS_UNREACHABLE`.
        AddressUnreachable = 98, /// `DAT_INVALID_ADDRESS_MALFORMED`.
        AddressMalformed = 99, /// `DAT_NAME_NOT_REGISTERED`.
        NameNotRegistered = 100, /// `DAT_MAJOR_NOT_FOUND`.
        MajorNotFound = 101, /// `DAT_MINOR_NOT_FOUND`.
        MinorNotFound = 102, /// `DAT_THREAD_SAFETY_NOT_FOUND`.
        ThreadSafetyNotFound = 103,
    }
}

/// `DAT_CLASS_ERROR`.
pub const CLASS_ERROR: u32 = 0x8000_0000;
/// `DAT_CLASS_WARNING`.
pub const CLASS_WARNING: u32 = 0x4000_0000;

/// A failed DAT operation: type and subtype of its `DAT_RETURN`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DatError {
    /// The type (`DAT_GET_TYPE`).
    pub ty: ErrorType,
    /// The subtype (`DAT_GET_SUBTYPE`).
    pub sub: Subtype,
}

impl core::fmt::Display for DatError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "{} {}", self.ty.name(), self.sub.name())
    }
}

impl core::error::Error for DatError {}

impl DatError {
    /// An error of this type and subtype.
    pub const fn new(ty: ErrorType, sub: Subtype) -> DatError {
        DatError { ty, sub }
    }

    /// An error of this type with no subtype.
    pub const fn of(ty: ErrorType) -> DatError {
        DatError {
            ty,
            sub: Subtype::None,
        }
    }

    /// The 32-bit `DAT_RETURN` (DAPL sets no class bit on errors; neither
    /// does this).
    pub const fn to_return(self) -> u32 {
        ((self.ty as u32) << 16) | self.sub as u32
    }

    /// Decodes a `DAT_RETURN` (the class bits are ignored). `Ok(None)` is
    /// `DAT_SUCCESS`; `Err(raw)` if the type or subtype is unknown.
    pub fn from_return(raw: u32) -> Result<Option<DatError>, u32> {
        let ty = u16::try_from((raw & 0x3fff_0000) >> 16).map_err(|_| raw)?;
        let sub = (raw & 0xffff) as u16;
        let ty = ErrorType::from_raw(ty).ok_or(raw)?;
        let sub = Subtype::from_raw(sub).ok_or(raw)?;
        if ty == ErrorType::Success && sub == Subtype::None {
            return Ok(None);
        }
        Ok(Some(DatError { ty, sub }))
    }
}

/// The `DAT_RETURN` of a result: 0 for success.
pub fn to_return<T>(r: &Result<T, DatError>) -> u32 {
    match r {
        Ok(_) => 0,
        Err(e) => e.to_return(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_type_and_subtype_round_trips() {
        for &ty in ErrorType::ALL {
            for &sub in Subtype::ALL {
                let raw = DatError::new(ty, sub).to_return();
                let back = DatError::from_return(raw).unwrap();
                if ty == ErrorType::Success && sub == Subtype::None {
                    assert_eq!(back, None);
                } else {
                    assert_eq!(back, Some(DatError::new(ty, sub)), "{raw:#x}");
                }
            }
        }
    }

    #[test]
    fn known_values_match_dat_error_h() {
        assert_eq!(
            DatError::of(ErrorType::NotImplemented).to_return(),
            0x3fff_0000
        );
        assert_eq!(DatError::of(ErrorType::QueueEmpty).to_return(), 0xd_0000);
        assert_eq!(
            DatError::of(ErrorType::TimeoutExpired).to_return(),
            0xf_0000
        );
        assert_eq!(
            DatError::new(ErrorType::ProviderNotFound, Subtype::NameNotRegistered).to_return(),
            0xa_0064
        );
        assert_eq!(Subtype::ThreadSafetyNotFound as u16, 103);
        assert_eq!(Subtype::EpUnconnected as u16, 47);
    }

    #[test]
    fn unknown_values_are_refused_not_guessed() {
        assert_eq!(DatError::from_return(0x0012_0000), Err(0x0012_0000));
        assert_eq!(DatError::from_return(0x0005_0fff), Err(0x0005_0fff));
        assert_eq!(
            DatError::from_return(CLASS_ERROR | 0x5_000c)
                .unwrap()
                .unwrap()
                .sub,
            Subtype::HandleEp
        );
    }
}
