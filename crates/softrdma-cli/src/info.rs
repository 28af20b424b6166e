//! `softrdma info`: the device's attributes, threads and defaults, like
//! `ibv_devinfo -v`.
