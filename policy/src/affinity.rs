//! CPU pinning and priority of the model threads. The learner and the rollout worker each
//! keep their model on one OS thread; pinning that thread (before libtorch
//! starts its intra-op threads, which inherit the mask) gives each role its
//! own cores on a shared machine (`[learner] cpu_affinity`,
//! `[worker] cpu_affinity`, `asyncrl-bench speedup`).

/// Pins the calling thread to `cores` (Linux; a no-op elsewhere or when
/// `cores` is empty). Threads it starts later inherit the mask.
pub fn pin_current_thread(cores: &[usize]) -> std::io::Result<()> {
    if cores.is_empty() {
        return Ok(());
    }
    #[cfg(target_os = "linux")]
    {
        // SAFETY: a zeroed cpu_set_t is the empty set; CPU_SET writes within
        // it for indices below CPU_SETSIZE (checked), and
        // sched_setaffinity(0, ..) applies to the calling thread only.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            for &c in cores {
                if c >= libc::CPU_SETSIZE as usize {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::InvalidInput,
                        format!("core {c} is beyond CPU_SETSIZE"),
                    ));
                }
                libc::CPU_SET(c, &mut set);
            }
            if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
    }
    Ok(())
}

/// Lowers the calling thread's CPU priority to nice value `nice` (Linux,
/// 1–19: the higher, the more it yields to threads at the default 0; a
/// no-op at 0, at or below the thread's nice value already, or elsewhere:
/// it never raises a priority). Threads it starts later inherit it. Only
/// the calling thread changes, never the process.
pub fn lower_current_thread_priority(nice: u8) -> std::io::Result<()> {
    if nice == 0 {
        return Ok(());
    }
    if nice > 19 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("nice {nice} is above 19"),
        ));
    }
    if current_thread_nice().is_some_and(|n| n >= i32::from(nice)) {
        return Ok(());
    }
    #[cfg(target_os = "linux")]
    {
        // SAFETY: gettid has no preconditions; setpriority(PRIO_PROCESS,
        // tid, ..) on Linux sets the nice value of that one thread.
        unsafe {
            let tid = libc::gettid();
            if libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, i32::from(nice)) != 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
    }
    Ok(())
}

/// The nice value of the calling thread (Linux; `None` elsewhere).
pub fn current_thread_nice() -> Option<i32> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: as above; getpriority returns the nice value, and -1 is
        // an error only when errno is set (cleared first).
        unsafe {
            let tid = libc::gettid();
            *libc::__errno_location() = 0;
            let nice = libc::getpriority(libc::PRIO_PROCESS, tid as libc::id_t);
            if nice == -1 && *libc::__errno_location() != 0 {
                return None;
            }
            Some(nice)
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        None
    }
}

/// The cores the calling thread may run on (Linux; `None` elsewhere).
pub fn current_thread_cores() -> Option<Vec<usize>> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: sched_getaffinity(0, ..) fills the set of the calling
        // thread; CPU_ISSET reads indices below CPU_SETSIZE only.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
                return None;
            }
            Some(
                (0..libc::CPU_SETSIZE as usize)
                    .filter(|&c| libc::CPU_ISSET(c, &set))
                    .collect(),
            )
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        None
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    #[test]
    fn pinning_applies_to_the_calling_thread_and_its_children_only() {
        let before = current_thread_cores().expect("affinity");
        let first = before[0];
        let (pinned, child) = std::thread::spawn(move || {
            pin_current_thread(&[first]).expect("pin");
            let child = std::thread::spawn(current_thread_cores)
                .join()
                .expect("child");
            (current_thread_cores(), child)
        })
        .join()
        .expect("thread");
        assert_eq!(pinned, Some(vec![first]));
        assert_eq!(child, Some(vec![first]), "threads started later inherit");
        assert_eq!(current_thread_cores(), Some(before), "others are untouched");
    }

    #[test]
    fn a_lower_priority_applies_to_the_calling_thread_and_its_children_only() {
        let before = current_thread_nice().expect("nice");
        let (niced, child) = std::thread::spawn(move || {
            lower_current_thread_priority(before.max(0) as u8 + 3).expect("nice");
            let child = std::thread::spawn(current_thread_nice)
                .join()
                .expect("child");
            (current_thread_nice(), child)
        })
        .join()
        .expect("thread");
        assert_eq!(niced, Some(before + 3));
        assert_eq!(child, Some(before + 3), "threads started later inherit");
        assert_eq!(current_thread_nice(), Some(before), "others are untouched");
        // Never raised: a value at or below the thread's changes nothing.
        let kept = std::thread::spawn(move || {
            lower_current_thread_priority(before.max(0) as u8 + 5).expect("nice");
            lower_current_thread_priority(before.max(0) as u8 + 2).expect("no-op");
            current_thread_nice()
        })
        .join()
        .expect("thread");
        assert_eq!(kept, Some(before + 5));
        let e = lower_current_thread_priority(20).expect_err("out of range");
        assert!(e.to_string().contains("nice 20"), "{e}");
    }

    #[test]
    fn empty_is_a_no_op_and_impossible_cores_are_errors() {
        let before = current_thread_cores();
        pin_current_thread(&[]).expect("no-op");
        assert_eq!(current_thread_cores(), before);
        let e = std::thread::spawn(|| pin_current_thread(&[1 << 20]))
            .join()
            .expect("thread")
            .expect_err("out of range");
        assert!(e.to_string().contains("core 1048576"), "{e}");
    }
}
