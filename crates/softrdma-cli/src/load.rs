//! Is the machine oversubscribed? Busy-polling numbers (softrdma polls its
//! completion queues, `--baseline tcp-spin` its sockets) need a CPU per
//! spinning thread; on a loaded machine they measure the scheduler. This
//! looks at the usable CPUs (the affinity mask and the cgroup v2 CPU quota
//! of `/sys/fs/cgroup/cpu.max`) and the load average, and words a warning
//! to print next to the numbers.

/// What was looked at.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Load {
    /// 1-minute load average (`/proc/loadavg`), if readable.
    pub load1: Option<f64>,
    /// CPUs in this process's affinity mask, if readable.
    pub affinity: Option<usize>,
    /// CPUs the cgroup's quota allows (quota / period), if limited.
    pub quota: Option<f64>,
}

impl Load {
    /// Reads the current figures of this machine and process.
    pub fn now() -> Load {
        Load {
            load1: std::fs::read_to_string("/proc/loadavg")
                .ok()
                .and_then(|s| s.split_whitespace().next()?.parse().ok()),
            affinity: affinity(),
            quota: std::fs::read_to_string("/sys/fs/cgroup/cpu.max")
                .ok()
                .and_then(|s| parse_cpu_max(&s)),
        }
    }

    /// CPUs this process can use: the affinity mask, lowered by the cgroup
    /// quota.
    pub fn usable(&self) -> Option<f64> {
        match (self.affinity, self.quota) {
            (Some(a), Some(q)) => Some((a as f64).min(q)),
            (Some(a), None) => Some(a as f64),
            (None, q) => q,
        }
    }

    /// A warning when a busy-polling measurement that needs `spinning`
    /// CPUs (e.g. 2: both ends of a loopback run) is likely to be
    /// distorted: fewer usable CPUs than that, or a load average at or
    /// above the usable CPUs. `None` when the machine looks fine (or
    /// nothing could be read).
    pub fn warning(&self, spinning: usize) -> Option<String> {
        let usable = self.usable()?;
        let mut why = Vec::new();
        if usable < spinning as f64 {
            why.push(format!(
                "{} usable CPU{} for {spinning} busy-polling threads",
                trim(usable),
                if usable == 1.0 { "" } else { "s" }
            ));
        }
        if let Some(l) = self.load1
            && l >= usable
        {
            why.push(format!(
                "load average {l:.2} on {} usable CPUs",
                trim(usable)
            ));
        }
        if why.is_empty() {
            return None;
        }
        Some(format!(
            "the machine looks oversubscribed ({}; affinity {}, cgroup quota {}): \
             busy-polled latencies measure the scheduler as much as the stack",
            why.join(", "),
            self.affinity.map_or("?".into(), |a| a.to_string()),
            self.quota
                .map_or("none".into(), |q| format!("{} CPUs", trim(q)))
        ))
    }
}

fn trim(x: f64) -> String {
    if x.fract() == 0.0 {
        format!("{x:.0}")
    } else {
        format!("{x:.2}")
    }
}

/// CPUs of a cgroup v2 `cpu.max` (`max 100000`: none; `150000 100000`:
/// 1.5).
pub fn parse_cpu_max(s: &str) -> Option<f64> {
    let mut it = s.split_whitespace();
    let quota = it.next()?;
    let period: f64 = it.next()?.parse().ok()?;
    if quota == "max" || period <= 0.0 {
        return None;
    }
    Some(quota.parse::<f64>().ok()? / period)
}

fn affinity() -> Option<usize> {
    let set = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)).ok()?;
    Some(
        (0..nix::sched::CpuSet::count())
            .filter(|&i| set.is_set(i).unwrap_or(false))
            .count(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_max() {
        assert_eq!(parse_cpu_max("max 100000\n"), None);
        assert_eq!(parse_cpu_max("150000 100000\n"), Some(1.5));
        assert_eq!(parse_cpu_max("garbage"), None);
    }

    #[test]
    fn warns_when_oversubscribed() {
        let idle = Load {
            load1: Some(0.3),
            affinity: Some(8),
            quota: None,
        };
        assert_eq!(idle.warning(2), None);
        let busy = Load {
            load1: Some(9.0),
            ..idle
        };
        let w = busy.warning(2).unwrap();
        assert!(w.contains("load average 9.00 on 8 usable CPUs"), "{w}");
        let quota = Load {
            quota: Some(1.5),
            ..idle
        };
        let w = quota.warning(2).unwrap();
        assert!(
            w.contains("1.50 usable CPUs for 2") && w.contains("quota 1.50"),
            "{w}"
        );
        let pinned = Load {
            affinity: Some(1),
            ..idle
        };
        assert!(pinned.warning(2).unwrap().contains("1 usable CPU for 2"));
        assert_eq!(
            Load {
                load1: None,
                affinity: None,
                quota: None
            }
            .warning(2),
            None
        );
    }
}
