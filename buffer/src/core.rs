//! The buffer's state machine, free of IO: which trajectories are held,
//! which groups are complete, what to serve for a learner step, what is
//! consumed, which segments hold nothing live any more.
//!
//! The same [`Core::apply`] runs for live ingest and for recovery from the
//! segments, in segment order, so a restarted buffer reaches the state the
//! crashed one had for everything that was acked. Decisions that depend on
//! the learner (what was served for which step, stale drops) come from the
//! served log ([`crate::statelog`]), which is written before they take
//! effect.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::Arc;

use arrow::array::{RecordBatch, UInt32Array};
use rand::Rng;
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

use asyncrl_config::SamplingPolicy;
use asyncrl_protos::subjects::split_wire_task_id;
use asyncrl_protos::{GroupDropReason, RewardStatus, Trajectory};

use crate::statelog::{DropReason, GroupRef, Quarantined, Record};

/// What the core needs to know about one stored trajectory.
#[derive(Debug, Clone, PartialEq)]
pub struct RowMeta {
    pub uuid: u128,
    pub task: Arc<str>,
    pub group: Arc<str>,
    pub index: u32,
    pub group_size: u32,
    pub admission_version: i32,
    pub oldest_version: i32,
    /// Prompt and completion tokens.
    pub tokens: u64,
    /// The episode's reward; `None` when it could not be computed (or is
    /// not finite), as the Arrow `reward` column's null.
    pub reward: Option<f32>,
}

impl RowMeta {
    /// The metadata of a validated trajectory (`None` if its uuid does not parse).
    pub fn of(t: &Trajectory) -> Option<Self> {
        Some(Self {
            uuid: uuid::Uuid::parse_str(&t.uuid).ok()?.as_u128(),
            task: Arc::from(t.task_id.as_str()),
            group: Arc::from(t.group_id.as_str()),
            index: t.index_in_group,
            group_size: t.group_size,
            admission_version: t.admission_version,
            oldest_version: t.oldest_version(),
            tokens: (t.prompt_token_ids.len() + t.completion_token_ids.len()) as u64,
            reward: (t.reward_status == RewardStatus::Ok as i32 && t.reward.is_finite())
                .then_some(t.reward),
        })
    }
}

/// Record batches and `(batch, row)` indices into them.
pub type Gathered = (Vec<RecordBatch>, Vec<(usize, usize)>);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RowRef {
    batch: u64,
    row: u32,
}

#[derive(Debug, Clone)]
struct Member {
    index: u32,
    uuid: u128,
    at: RowRef,
    segment: u64,
    tokens: u64,
    oldest: i32,
    reward: Option<f32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GroupState {
    /// Fewer than G members so far.
    Collecting,
    /// Complete and servable.
    Ready,
    /// Served K times (or expired after serving): never served again, held
    /// only until the last step it was served for is trained.
    Exhausted,
}

#[derive(Debug, Clone)]
struct Group {
    task: Arc<str>,
    id: Arc<str>,
    size: u32,
    admission: i32,
    members: Vec<Member>,
    state: GroupState,
    /// Ingest ordinal of the member that completed the group.
    order: u64,
    serves: u32,
    /// The latest step this group was served for (0: never).
    last_step: u64,
}

impl Group {
    fn oldest(&self) -> i32 {
        self.members
            .iter()
            .map(|m| m.oldest)
            .min()
            .unwrap_or(i32::MAX)
    }

    /// Dynamic sampling: every member has a reward and the rewards span
    /// less than `min_spread` (never with `min_spread` 0). A member without
    /// a reward (its scoring failed) makes the spread unknown: the learner
    /// masks that member and may still learn from the others, so the group
    /// is kept.
    fn no_signal(&self, min_spread: f64) -> bool {
        if min_spread <= 0.0 {
            return false;
        }
        let mut lo = f64::INFINITY;
        let mut hi = f64::NEG_INFINITY;
        for m in &self.members {
            let Some(r) = m.reward else {
                return false;
            };
            lo = lo.min(f64::from(r));
            hi = hi.max(f64::from(r));
        }
        !self.members.is_empty() && hi - lo < min_spread
    }

    fn gref(&self) -> GroupRef {
        GroupRef {
            task: self.task.to_string(),
            group: self.id.to_string(),
        }
    }
}

/// The ready groups, kept in two orders: by (admission version, completion
/// order), the order they are served and dropped in, and by (oldest token
/// version, completion order), so that the staleness check of a request
/// reads only the groups below its floor.
#[derive(Default)]
struct ReadyGroups {
    by_admission: BTreeSet<(i32, u64, Arc<str>)>,
    by_oldest: BTreeSet<(i32, u64, Arc<str>)>,
}

impl ReadyGroups {
    fn insert(&mut self, g: &Group) {
        self.by_admission
            .insert((g.admission, g.order, g.id.clone()));
        self.by_oldest.insert((g.oldest(), g.order, g.id.clone()));
    }

    fn remove(&mut self, g: &Group) {
        self.by_admission
            .remove(&(g.admission, g.order, g.id.clone()));
        self.by_oldest.remove(&(g.oldest(), g.order, g.id.clone()));
    }

    fn len(&self) -> usize {
        debug_assert_eq!(self.by_admission.len(), self.by_oldest.len());
        self.by_admission.len()
    }

    /// Ids in admission order.
    fn ids(&self) -> impl DoubleEndedIterator<Item = &Arc<str>> {
        self.by_admission.iter().map(|(_, _, id)| id)
    }

    /// Ids of the groups whose oldest token version is below `floor`.
    fn older_than(&self, floor: i64) -> impl Iterator<Item = &Arc<str>> {
        self.by_oldest
            .iter()
            .take_while(move |(oldest, _, _)| i64::from(*oldest) < floor)
            .map(|(_, _, id)| id)
    }
}

struct MemBatch {
    batch: RecordBatch,
    /// The group owning each row; `None` for rows that are not live.
    owners: Vec<Option<Arc<str>>>,
    live: usize,
    bytes: usize,
}

/// A group the buffer gave up on, to be counted and reported.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DroppedGroup {
    pub task: String,
    pub group: String,
    pub reason: GroupDropReason,
    pub trajectories: u32,
}

/// What [`Core::apply`] did with a record batch.
#[derive(Debug, Default)]
pub struct Applied {
    pub stored: usize,
    pub duplicates: usize,
    /// Trajectories of an attempt whose task another attempt completed.
    pub superseded: usize,
    /// Rows that break the group contract, with the reason (dead-lettered).
    pub violations: Vec<(usize, String)>,
    pub dropped: Vec<DroppedGroup>,
    pub newly_ready: usize,
}

#[derive(Debug, Clone)]
struct ServedStep {
    version: i32,
    eta: u32,
    groups: Vec<Arc<str>>,
    trained_through: u64,
}

/// A learner's batch request, as the core sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ask {
    pub step: u64,
    pub version: i32,
    pub eta: u32,
    pub num_groups: usize,
    /// The last step the learner has trained: `step - 1`, or less for a
    /// prefetch (asked while `step - 1` trains). Groups served after it are
    /// held, so that a refused step can be served anew.
    pub trained_through: u64,
}

impl Ask {
    /// A request for `step` from a learner that has trained `step - 1`.
    pub fn next(step: u64, version: i32, eta: u32, num_groups: usize) -> Self {
        Self {
            step,
            version,
            eta,
            num_groups,
            trained_through: step.saturating_sub(1),
        }
    }
}

/// The learner's refusal of groups it was served for a step, planned
/// without changing the core: the caller dead-letters the groups' rows
/// ([`Core::gather`] of [`Refusal::groups`]), persists
/// [`Core::refusal_record`] and then calls [`Core::commit_refusal`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub step: u64,
    /// The refused groups the step holds, with the learner's reason.
    pub groups: Vec<(Arc<str>, String)>,
}

/// A decision about a batch request, made without changing the core; the
/// caller persists [`Plan::records`] and then calls [`Core::commit`].
#[derive(Debug)]
pub struct Plan {
    pub ask: Ask,
    pub outcome: Outcome,
    /// Groups to drop for staleness (persisted, then applied).
    pub drops: Vec<(Arc<str>, DropReason)>,
    reuse_queue: Option<VecDeque<Arc<str>>>,
    rng: Option<StdRng>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Serve these groups (in this order) for the step.
    Serve(Vec<Arc<str>>),
    /// The step was served before: serve the same groups again.
    Replay(Vec<Arc<str>>),
    /// Fewer than the asked number of groups are ready.
    NotReady { ready: usize },
    /// The request cannot be answered (the reason goes back to the learner).
    Refused(String),
}

/// A point-in-time view of the core, for metrics and tests.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    pub ready_groups: usize,
    pub collecting_groups: usize,
    pub exhausted_groups: usize,
    pub live_trajectories: usize,
    pub live_tokens: u64,
    pub resident_bytes: u64,
    pub memory_batches: usize,
    pub done_through: u64,
    pub pending_steps: usize,
    pub completed_tasks: usize,
    pub closed_epoch: Option<u64>,
}

/// A completed task's entry in `Core::task_done`.
#[derive(Debug, Clone)]
struct Done {
    /// The group kept for the task.
    kept: Arc<str>,
    /// The kept group will never be served again and is released.
    consumed: bool,
    /// The segment of the task's latest row applied (any attempt); 0 when
    /// none was applied since a restart (all in deleted segments).
    seg: u64,
}

impl Done {
    fn consumed(group: &str) -> Self {
        Self {
            kept: Arc::from(group),
            consumed: true,
            seg: 0,
        }
    }
}

#[derive(Debug, Default)]
struct Restore {
    serves: u32,
    last_step: u64,
    expired: bool,
}

pub struct Core {
    sampling: SamplingPolicy,
    max_serves: u32,
    /// `buffer.min_reward_spread` (0: dynamic sampling off).
    min_reward_spread: f64,
    /// Ready groups never served that carry no signal (dynamic sampling),
    /// by (admission version, completion order): the next plan drops them
    /// (`no_signal`) before it serves, with a record in the served log.
    no_signal: BTreeSet<(i32, u64, Arc<str>)>,
    batches: HashMap<u64, MemBatch>,
    next_batch: u64,
    groups: HashMap<Arc<str>, Group>,
    /// Incomplete groups of each task that has not completed.
    task_groups: HashMap<Arc<str>, Vec<Arc<str>>>,
    /// Completed tasks: the group kept for each, whether that group is
    /// consumed, and the segment of the task's latest row. A consumed task
    /// of a closed epoch is forgotten once that segment is deleted: no row
    /// of it is left to replay, and a late one is dropped at ingest.
    task_done: HashMap<Arc<str>, Done>,
    /// Every data set epoch up to this one is closed (the coordinator's
    /// `coordinator.closed_epoch`): none of its tasks will be issued again.
    closed_epoch: Option<u64>,
    /// Per task, its groups dropped as stale before they were served, while
    /// no other attempt of it has been trained on: the coordinator issued
    /// the task again, so the task stays open for that attempt (it is not
    /// in `task_done`), and a recovery skips these groups' rows.
    stale: HashMap<Arc<str>, Vec<Arc<str>>>,
    live_uuids: HashSet<u128>,
    /// Trajectories dropped so far of each attempt that lost its task.
    late: HashMap<Arc<str>, u32>,
    /// Per task, its attempts superseded by a kept one (group ids).
    superseded: HashMap<Arc<str>, Vec<Arc<str>>>,
    ready: ReadyGroups,
    reuse_queue: VecDeque<Arc<str>>,
    rng: StdRng,
    served: BTreeMap<u64, ServedStep>,
    done_through: u64,
    /// Live rows per segment (every known segment has an entry).
    seg_live: BTreeMap<u64, u64>,
    active_segment: u64,
    next_order: u64,
    resident_bytes: u64,
    live_tokens: u64,
    live_rows: usize,
    /// Served-log facts about groups, waiting for their rows during recovery.
    restore: HashMap<Arc<str>, Restore>,
}

impl Core {
    pub fn new(sampling: SamplingPolicy, max_serves: u32, seed: u64) -> Self {
        Self {
            sampling,
            max_serves: max_serves.max(1),
            min_reward_spread: 0.0,
            no_signal: BTreeSet::new(),
            batches: HashMap::new(),
            next_batch: 0,
            groups: HashMap::new(),
            task_groups: HashMap::new(),
            task_done: HashMap::new(),
            closed_epoch: None,
            stale: HashMap::new(),
            live_uuids: HashSet::new(),
            late: HashMap::new(),
            superseded: HashMap::new(),
            ready: ReadyGroups::default(),
            reuse_queue: VecDeque::new(),
            rng: StdRng::seed_from_u64(seed),
            served: BTreeMap::new(),
            done_through: 0,
            seg_live: BTreeMap::new(),
            active_segment: 0,
            next_order: 0,
            resident_bytes: 0,
            live_tokens: 0,
            live_rows: 0,
            restore: HashMap::new(),
        }
    }

    /// Dynamic sampling: complete groups whose rewards span less than
    /// `min_spread` are dropped before they are served (0: off).
    pub fn with_min_reward_spread(mut self, min_spread: f64) -> Self {
        self.min_reward_spread = min_spread;
        self
    }

    // ------------------------------------------------------------ ingest

    /// Whether a trajectory with this uuid is held now.
    pub fn is_live(&self, uuid: u128) -> bool {
        self.live_uuids.contains(&uuid)
    }

    /// Whether [`Core::apply`] would drop this trajectory as a duplicate
    /// without looking at its contents: it is held now, or it belongs to the
    /// kept group of a task already trained on (a redelivery after an ack
    /// that was lost, e.g. when the server restarted). Ingest skips these
    /// before writing, so a redelivered trajectory is not stored twice.
    pub fn is_known(&self, m: &RowMeta) -> bool {
        self.live_uuids.contains(&m.uuid)
            || self
                .task_done
                .get(&m.task)
                .is_some_and(|d| d.consumed && d.kept == m.group)
    }

    /// Whether this trajectory is a late copy of a closed epoch's task that
    /// the buffer holds nothing of: no attempt of that task will be counted
    /// or trained again, so ingest drops it without storing it. (A task
    /// still remembered is judged by [`Core::apply`], as before its epoch
    /// closed.)
    pub fn is_late(&self, m: &RowMeta) -> bool {
        self.closed(&m.task)
            && !self.task_done.contains_key(&m.task)
            && !self.task_groups.contains_key(&m.task)
            && !self.stale.contains_key(&m.task)
    }

    /// Whether `task`'s epoch is closed (false for an id without one).
    fn closed(&self, task: &str) -> bool {
        self.closed_epoch.is_some_and(|through| {
            split_wire_task_id(task).is_some_and(|(_, epoch)| epoch <= through)
        })
    }

    /// The highest closed epoch known.
    pub fn closed_epoch(&self) -> Option<u64> {
        self.closed_epoch
    }

    /// Every epoch up to `through` is closed (the highest value seen is
    /// kept: a lower one changes nothing). Attempts of closed epochs still
    /// collecting are late copies and released (returned for the drop
    /// report), and the consumed tasks whose rows are all deleted are
    /// forgotten. Ingest calls it between batches, so a batch is judged
    /// [`Core::is_late`] under one closed epoch throughout.
    pub fn close_epochs(&mut self, through: u64) -> Vec<DroppedGroup> {
        self.closed_epoch = self.closed_epoch.max(Some(through));
        let late: Vec<Arc<str>> = self
            .task_groups
            .iter()
            .filter(|(task, _)| self.closed(task))
            .flat_map(|(_, groups)| groups.iter().cloned())
            .collect();
        let mut dropped = Vec::new();
        for id in late {
            if let Some(g) = self.release(&id) {
                dropped.push(DroppedGroup {
                    task: g.task.to_string(),
                    group: g.id.to_string(),
                    reason: GroupDropReason::DuplicateAttempt,
                    trajectories: g.members.len() as u32,
                });
            }
        }
        self.forget_closed();
        dropped
    }

    /// Forgets the consumed tasks of closed epochs whose latest row is in a
    /// deleted segment (older than every segment still known).
    fn forget_closed(&mut self) {
        if self.closed_epoch.is_none() {
            return;
        }
        let oldest = self
            .seg_live
            .keys()
            .next()
            .copied()
            .unwrap_or(self.active_segment)
            .min(self.active_segment);
        let closed_epoch = self.closed_epoch;
        self.task_done.retain(|task, d| {
            let closed = closed_epoch.is_some_and(|through| {
                split_wire_task_id(task).is_some_and(|(_, epoch)| epoch <= through)
            });
            !(d.consumed && closed && d.seg < oldest)
        });
    }

    /// Registers a segment (so that it is reported deletable once nothing
    /// live is in it) and, if `active`, makes it the one being written.
    pub fn add_segment(&mut self, id: u64, active: bool) {
        self.seg_live.entry(id).or_insert(0);
        if active {
            self.active_segment = id;
        }
    }

    /// Takes in a record batch that was written to `segment`, row by row in
    /// order. `replay` is set during recovery (no reports, no late-attempt
    /// bookkeeping).
    pub fn apply(
        &mut self,
        batch: RecordBatch,
        metas: &[RowMeta],
        segment: u64,
        replay: bool,
    ) -> Applied {
        let mut out = Applied::default();
        let batch_id = self.next_batch;
        self.next_batch += 1;
        let mut owners: Vec<Option<Arc<str>>> = vec![None; metas.len()];
        self.seg_live.entry(segment).or_insert(0);
        for (row, m) in metas.iter().enumerate() {
            let order = self.next_order;
            self.next_order += 1;
            if self.live_uuids.contains(&m.uuid) {
                out.duplicates += 1;
                continue;
            }
            if self
                .stale
                .get(&m.task)
                .is_some_and(|groups| groups.contains(&m.group))
            {
                // A copy of a row of a group dropped as stale (redelivered,
                // or replayed by a recovery).
                out.duplicates += 1;
                continue;
            }
            if let Some(d) = self.task_done.get_mut(&m.task) {
                d.seg = d.seg.max(segment);
                let (kept, consumed) = (d.kept.clone(), d.consumed);
                if kept != m.group {
                    out.superseded += 1;
                    // Only an open task's superseded attempts matter (the
                    // records of its kept group's drop name them); a
                    // consumed task's are history.
                    if !consumed {
                        let of_task = self.superseded.entry(m.task.clone()).or_default();
                        if !of_task.contains(&m.group) {
                            of_task.push(m.group.clone());
                        }
                    }
                    if !replay {
                        let n = self.late.entry(m.group.clone()).or_insert(0);
                        *n += 1;
                        if *n == m.group_size {
                            // Reported once; its count is no longer needed.
                            self.late.remove(&m.group);
                            out.dropped.push(DroppedGroup {
                                task: m.task.to_string(),
                                group: m.group.to_string(),
                                reason: GroupDropReason::DuplicateAttempt,
                                trajectories: m.group_size,
                            });
                        }
                    }
                } else if consumed {
                    // A copy of a trajectory of a group already trained on.
                    out.duplicates += 1;
                } else {
                    out.violations.push((
                        row,
                        format!(
                            "group `{}` is already complete; index_in_group {} is one member too many",
                            m.group, m.index
                        ),
                    ));
                }
                continue;
            }
            if let Some(g) = self.groups.get(&m.group) {
                let problem = if g.task != m.task {
                    Some(format!(
                        "group `{}` belongs to task `{}`, not `{}`",
                        m.group, g.task, m.task
                    ))
                } else if g.size != m.group_size {
                    Some(format!(
                        "group_size {} differs from {} of the group's first member",
                        m.group_size, g.size
                    ))
                } else if g.members.iter().any(|x| x.index == m.index) {
                    Some(format!(
                        "index_in_group {} of group `{}` is already taken by another trajectory",
                        m.index, m.group
                    ))
                } else {
                    None
                };
                if let Some(problem) = problem {
                    out.violations.push((row, problem));
                    continue;
                }
            }
            // Stored.
            let member = Member {
                index: m.index,
                uuid: m.uuid,
                at: RowRef {
                    batch: batch_id,
                    row: row as u32,
                },
                segment,
                tokens: m.tokens,
                oldest: m.oldest_version,
                reward: m.reward,
            };
            owners[row] = Some(m.group.clone());
            self.live_uuids.insert(m.uuid);
            *self.seg_live.entry(segment).or_insert(0) += 1;
            self.live_tokens += m.tokens;
            self.live_rows += 1;
            out.stored += 1;
            let group = self.groups.entry(m.group.clone()).or_insert_with(|| {
                self.task_groups
                    .entry(m.task.clone())
                    .or_default()
                    .push(m.group.clone());
                Group {
                    task: m.task.clone(),
                    id: m.group.clone(),
                    size: m.group_size,
                    admission: m.admission_version,
                    members: Vec::with_capacity(m.group_size as usize),
                    state: GroupState::Collecting,
                    order: 0,
                    serves: 0,
                    last_step: 0,
                }
            });
            group.members.push(member);
            if group.members.len() as u32 == group.size {
                group.state = GroupState::Ready;
                group.order = order;
                group.members.sort_by_key(|x| x.index);
                let (task, id) = (group.task.clone(), group.id.clone());
                self.task_done.insert(
                    task.clone(),
                    Done {
                        kept: id.clone(),
                        consumed: false,
                        seg: segment,
                    },
                );
                self.ready.insert(group);
                if group.no_signal(self.min_reward_spread) {
                    self.no_signal
                        .insert((group.admission, group.order, group.id.clone()));
                }
                out.newly_ready += 1;
                if !replay && self.sampling == SamplingPolicy::Reuse {
                    let at = self.rng.random_range(0..=self.reuse_queue.len());
                    self.reuse_queue.insert(at, id.clone());
                }
                // Every other attempt of this task is superseded.
                let others = self.task_groups.remove(&task).unwrap_or_default();
                for other in others.into_iter().filter(|o| *o != id) {
                    let of_task = self.superseded.entry(task.clone()).or_default();
                    if !of_task.contains(&other) {
                        of_task.push(other.clone());
                    }
                    if let Some(g) = self.release(&other) {
                        out.dropped.push(DroppedGroup {
                            task: g.task.to_string(),
                            group: g.id.to_string(),
                            reason: GroupDropReason::Superseded,
                            trajectories: g.members.len() as u32,
                        });
                    }
                }
            }
        }
        let live = owners.iter().filter(|o| o.is_some()).count();
        if live > 0 {
            let bytes = batch.get_array_memory_size();
            self.resident_bytes += bytes as u64;
            self.batches.insert(
                batch_id,
                MemBatch {
                    batch,
                    owners,
                    live,
                    bytes,
                },
            );
        }
        out
    }

    /// Removes a group and frees its rows. Returns it.
    fn release(&mut self, id: &Arc<str>) -> Option<Group> {
        let g = self.groups.remove(id)?;
        self.ready.remove(&g);
        self.no_signal.remove(&(g.admission, g.order, g.id.clone()));
        if g.state == GroupState::Collecting
            && let Some(list) = self.task_groups.get_mut(&g.task)
        {
            list.retain(|x| x != id);
            if list.is_empty() {
                self.task_groups.remove(&g.task);
            }
        }
        let mut touched = BTreeSet::new();
        for m in &g.members {
            self.live_uuids.remove(&m.uuid);
            self.live_tokens -= m.tokens;
            self.live_rows -= 1;
            if let Some(n) = self.seg_live.get_mut(&m.segment) {
                *n = n.saturating_sub(1);
            }
            if let Some(b) = self.batches.get_mut(&m.at.batch) {
                if b.owners[m.at.row as usize].take().is_some() {
                    b.live -= 1;
                }
                touched.insert(m.at.batch);
            }
        }
        for batch in touched {
            self.tidy_batch(batch);
        }
        Some(g)
    }

    /// Drops an empty memory batch; rewrites a mostly dead one with only its
    /// live rows, so that resident memory follows live data.
    fn tidy_batch(&mut self, id: u64) {
        let Some(b) = self.batches.get(&id) else {
            return;
        };
        if b.live == 0 {
            if let Some(b) = self.batches.remove(&id) {
                self.resident_bytes -= b.bytes as u64;
            }
            return;
        }
        let rows = b.owners.len();
        if rows < 8 || b.live * 4 > rows {
            return;
        }
        let keep: Vec<u32> = (0..rows as u32)
            .filter(|r| b.owners[*r as usize].is_some())
            .collect();
        let Ok(compact) =
            arrow::compute::take_record_batch(&b.batch, &UInt32Array::from(keep.clone()))
        else {
            return; // keep the sparse batch; correct, just larger
        };
        let Some(old) = self.batches.remove(&id) else {
            return;
        };
        let new_id = self.next_batch;
        self.next_batch += 1;
        let mut owners = Vec::with_capacity(keep.len());
        for (new_row, old_row) in keep.iter().enumerate() {
            let owner = old.owners[*old_row as usize].clone();
            if let Some(g) = owner.as_ref().and_then(|o| self.groups.get_mut(o)) {
                for m in g.members.iter_mut() {
                    if m.at
                        == (RowRef {
                            batch: id,
                            row: *old_row,
                        })
                    {
                        m.at = RowRef {
                            batch: new_id,
                            row: new_row as u32,
                        };
                    }
                }
            }
            owners.push(owner);
        }
        let bytes = compact.get_array_memory_size();
        self.resident_bytes = self.resident_bytes - old.bytes as u64 + bytes as u64;
        self.batches.insert(
            new_id,
            MemBatch {
                batch: compact,
                live: owners.len(),
                owners,
                bytes,
            },
        );
    }

    /// Segments that hold nothing live and are not being written: safe to
    /// delete once the records that consumed their groups are durable.
    pub fn deletable_segments(&self) -> Vec<u64> {
        self.seg_live
            .iter()
            .filter(|(id, live)| **live == 0 && **id != self.active_segment)
            .map(|(id, _)| *id)
            .collect()
    }

    /// Forgets a deleted segment, and the consumed tasks of closed epochs
    /// whose rows it was the last to hold.
    pub fn forget_segment(&mut self, id: u64) {
        if self.seg_live.get(&id) == Some(&0) {
            self.seg_live.remove(&id);
            self.forget_closed();
        }
    }

    // ------------------------------------------------------------ serving

    fn eligible(&self, g: &Group) -> bool {
        g.state == GroupState::Ready && g.serves < self.max_serves
    }

    /// The groups of `refused` (group id, reason) that `step` was served
    /// and that are still held: `None` when there are none (a retried
    /// request whose refusal was already applied, or groups never served
    /// for the step).
    pub fn plan_refusal(&self, step: u64, refused: &[(String, String)]) -> Option<Refusal> {
        let served = self.served.get(&step)?;
        let groups: Vec<(Arc<str>, String)> = refused
            .iter()
            .filter_map(|(id, reason)| {
                let id = served.groups.iter().find(|g| ***g == **id)?;
                self.groups
                    .contains_key(id)
                    .then(|| (id.clone(), reason.clone()))
            })
            .collect();
        (!groups.is_empty()).then_some(Refusal { step, groups })
    }

    /// The record that makes a refusal durable.
    pub fn refusal_record(&self, refusal: &Refusal) -> Record {
        let groups = refusal
            .groups
            .iter()
            .filter_map(|(id, _)| self.groups.get(id))
            .map(|g| Quarantined {
                group: g.gref(),
                trajectories: g.members.len() as u32,
                closed: self
                    .superseded
                    .get(&g.task)
                    .map(|groups| groups.iter().map(|x| x.to_string()).collect())
                    .unwrap_or_default(),
            })
            .collect();
        let mut reasons: Vec<&str> = refusal.groups.iter().map(|(_, r)| r.as_str()).collect();
        reasons.dedup();
        Record::Refused {
            step: refusal.step,
            groups,
            reason: reasons.join("; "),
            stale: self
                .unserved_stale(refusal)
                .into_iter()
                .filter_map(|id| self.groups.get(&id))
                .map(|g| Quarantined {
                    group: g.gref(),
                    trajectories: g.members.len() as u32,
                    closed: self
                        .superseded
                        .get(&g.task)
                        .map(|groups| groups.iter().map(|x| x.to_string()).collect())
                        .unwrap_or_default(),
                })
                .collect(),
        }
    }

    /// The groups of a refused step, other than the refused ones, that had
    /// expired and whose one serve was this step's: taking it back leaves
    /// a group never trained, so [`Core::commit_refusal`] drops them as
    /// stale.
    fn unserved_stale(&self, refusal: &Refusal) -> Vec<Arc<str>> {
        let Some(step) = self.served.get(&refusal.step) else {
            return Vec::new();
        };
        step.groups
            .iter()
            .filter(|id| !refusal.groups.iter().any(|(r, _)| r == *id))
            .filter(|id| {
                self.groups.get(*id).is_some_and(|g| {
                    g.state == GroupState::Exhausted && g.serves == 1 && g.serves < self.max_serves
                })
            })
            .cloned()
            .collect()
    }

    /// Applies a refusal whose record is durable: the refused groups are
    /// released and their tasks reopened (the coordinator issues them
    /// again), the step's other groups count one serve fewer (servable
    /// again; one that expired meanwhile is a stale drop when no serve of it
    /// is left), and the step is forgotten, to be served anew. Returns the
    /// groups dropped: the quarantined and those stale drops.
    pub fn commit_refusal(&mut self, refusal: Refusal) -> Vec<DroppedGroup> {
        let Some(step) = self.served.remove(&refusal.step) else {
            return Vec::new();
        };
        let refused: HashSet<&Arc<str>> = refusal.groups.iter().map(|(id, _)| id).collect();
        let mut dropped = Vec::new();
        for id in step.groups.iter().filter(|id| !refused.contains(id)) {
            self.unserve(id);
            let Some(g) = self.groups.get(id) else {
                continue;
            };
            if g.state != GroupState::Exhausted {
                continue;
            }
            if g.serves > 0 {
                // Expired, and trained at an earlier step: final once that
                // step is (it may be already).
                self.settle(id);
                continue;
            }
            // Expired, and its one serve was this step's (the record's
            // `stale`): never trained, so a stale drop, and its task is
            // issued again.
            dropped.extend(self.drop_and_reopen(id, GroupDropReason::Stale));
        }
        for (id, _) in &refusal.groups {
            dropped.extend(self.drop_and_reopen(id, GroupDropReason::Quarantined));
        }
        dropped
    }

    /// Releases a group and reopens its task for the attempt the
    /// coordinator issues next (the attempts superseded so far stay
    /// superseded); the drop to report.
    fn drop_and_reopen(&mut self, id: &Arc<str>, reason: GroupDropReason) -> Option<DroppedGroup> {
        let task = self.groups.get(id)?.task.clone();
        let closed = self.superseded.get(&task).cloned().unwrap_or_default();
        let dropped = self.release(id).map(|g| DroppedGroup {
            task: g.task.to_string(),
            group: g.id.to_string(),
            reason,
            trajectories: g.members.len() as u32,
        });
        self.reopen(&task, id, closed);
        dropped
    }

    /// One serve of a group is taken back (its step was refused): it is
    /// servable again if that serve was what exhausted it.
    fn unserve(&mut self, id: &Arc<str>) {
        let max_serves = self.max_serves;
        // The latest step still holding it (the forgotten step is out of
        // `served` already); none: only trained steps did, so a settle can
        // release it (else a group that expires later would wait for a
        // settle that never comes, holding its rows and its segment).
        let latest = self
            .served
            .iter()
            .filter(|(_, s)| s.groups.contains(id))
            .map(|(step, _)| *step)
            .max();
        let done_through = self.done_through;
        let Some(g) = self.groups.get_mut(id) else {
            return;
        };
        g.last_step = latest.unwrap_or(g.last_step.min(done_through));
        let was_exhausted_by_serving = g.state == GroupState::Exhausted && g.serves >= max_serves;
        g.serves = g.serves.saturating_sub(1);
        if was_exhausted_by_serving && g.serves < max_serves {
            g.state = GroupState::Ready;
            let g = g.clone();
            self.ready.insert(&g);
        }
    }

    /// Decides what to answer to a batch request, without changing anything.
    pub fn plan(&self, ask: Ask) -> Plan {
        let mut plan = Plan {
            ask,
            outcome: Outcome::NotReady { ready: 0 },
            drops: Vec::new(),
            reuse_queue: None,
            rng: None,
        };
        if ask.step == 0 {
            plan.outcome = Outcome::Refused("step must be 1 or more".into());
            return plan;
        }
        if let Some(s) = self.served.get(&ask.step) {
            let missing: Vec<&Arc<str>> = s
                .groups
                .iter()
                .filter(|g| !self.groups.contains_key(*g))
                .collect();
            plan.outcome = if missing.is_empty() {
                Outcome::Replay(s.groups.clone())
            } else {
                Outcome::Refused(format!(
                    "step {} was served before, but {} of its groups are not held any more ({})",
                    ask.step,
                    missing.len(),
                    missing[0]
                ))
            };
            return plan;
        }
        if ask.step <= self.done_through {
            plan.outcome = Outcome::Refused(format!(
                "step {} is already trained (a request for step {} came before)",
                ask.step,
                self.done_through + 1
            ));
            return plan;
        }
        if ask.num_groups == 0 {
            plan.outcome = Outcome::Refused("num_groups is 0".into());
            return plan;
        }
        // Staleness: no token older than v − η is ever served.
        let floor = i64::from(ask.version) - i64::from(ask.eta);
        // Only the groups below the floor are read; the drops keep the
        // admission order.
        let mut dropped = HashSet::new();
        let mut stale: Vec<(i32, u64, &Arc<str>, DropReason)> = Vec::new();
        for id in self.ready.older_than(floor) {
            if let Some(g) = self.groups.get(id) {
                let why = if g.serves == 0 {
                    DropReason::Stale
                } else {
                    DropReason::Expired
                };
                stale.push((g.admission, g.order, id, why));
            }
        }
        stale.sort_unstable_by_key(|&(admission, order, _, _)| (admission, order));
        for (_, _, id, why) in stale {
            plan.drops.push((id.clone(), why));
            dropped.insert(id.clone());
        }
        // Dynamic sampling: the groups without signal never served (a
        // stale one is a stale drop above: its task is issued again).
        for (_, _, id) in &self.no_signal {
            if !dropped.contains(id)
                && self
                    .groups
                    .get(id)
                    .is_some_and(|g| g.state == GroupState::Ready && g.serves == 0)
            {
                plan.drops.push((id.clone(), DropReason::NoSignal));
                dropped.insert(id.clone());
            }
        }
        let usable = |id: &Arc<str>| {
            !dropped.contains(id) && self.groups.get(id).is_some_and(|g| self.eligible(g))
        };
        // Counted up to what the request needs: a million resident groups
        // are not walked to serve 64.
        let ready = self
            .ready
            .ids()
            .filter(|id| usable(id))
            .take(ask.num_groups)
            .count();
        if ready < ask.num_groups {
            plan.outcome = Outcome::NotReady { ready };
            return plan;
        }
        let chosen: Vec<Arc<str>> = match self.sampling {
            SamplingPolicy::Fifo => self
                .ready
                .ids()
                .filter(|id| usable(id))
                .take(ask.num_groups)
                .cloned()
                .collect(),
            SamplingPolicy::FreshFirst => self
                .ready
                .ids()
                .rev()
                .filter(|id| usable(id))
                .take(ask.num_groups)
                .cloned()
                .collect(),
            SamplingPolicy::Reuse => {
                let mut queue = self.reuse_queue.clone();
                let mut rng = self.rng.clone();
                let mut chosen = Vec::with_capacity(ask.num_groups);
                let mut taken = HashSet::new();
                let mut deferred = Vec::new();
                while chosen.len() < ask.num_groups {
                    match queue.pop_front() {
                        Some(id) if !usable(&id) => {}
                        Some(id) if taken.contains(&id) => deferred.push(id),
                        Some(id) => {
                            taken.insert(id.clone());
                            chosen.push(id);
                        }
                        None => {
                            // The pass is over: a new random permutation of
                            // every eligible group.
                            let mut pass: Vec<Arc<str>> =
                                self.ready.ids().filter(|id| usable(id)).cloned().collect();
                            pass.shuffle(&mut rng);
                            queue = pass.into();
                            if queue.iter().all(|id| taken.contains(id)) {
                                break; // cannot happen: ready >= num_groups
                            }
                        }
                    }
                }
                for id in deferred.into_iter().rev() {
                    queue.push_front(id);
                }
                plan.reuse_queue = Some(queue);
                plan.rng = Some(rng);
                chosen
            }
        };
        plan.outcome = Outcome::Serve(chosen);
        plan
    }

    /// The records that make a plan durable (append them before [`Core::commit`]).
    pub fn records(&self, plan: &Plan, unix_ms: i64) -> Vec<Record> {
        let mut out = Vec::new();
        for (id, why) in &plan.drops {
            if let Some(g) = self.groups.get(id) {
                let closed = match why {
                    DropReason::Stale => self
                        .superseded
                        .get(&g.task)
                        .map(|groups| groups.iter().map(|x| x.to_string()).collect())
                        .unwrap_or_default(),
                    DropReason::Expired | DropReason::NoSignal => Vec::new(),
                };
                out.push(Record::Dropped {
                    group: g.gref(),
                    reason: *why,
                    trajectories: g.members.len() as u32,
                    version: plan.ask.version,
                    closed,
                });
            }
        }
        if let Outcome::Serve(groups) = &plan.outcome {
            out.push(Record::Served {
                step: plan.ask.step,
                version: plan.ask.version,
                eta: plan.ask.eta,
                groups: groups
                    .iter()
                    .filter_map(|id| self.groups.get(id).map(Group::gref))
                    .collect(),
                unix_ms,
                trained_through: Some(plan.ask.trained_through),
            });
        }
        out
    }

    /// Applies a plan whose records are durable. Returns the groups dropped.
    pub fn commit(&mut self, plan: Plan) -> Vec<DroppedGroup> {
        let mut dropped = Vec::new();
        for (id, why) in &plan.drops {
            let Some(g) = self.groups.get_mut(id) else {
                continue;
            };
            let info = DroppedGroup {
                task: g.task.to_string(),
                group: g.id.to_string(),
                reason: match why {
                    DropReason::Stale => GroupDropReason::Stale,
                    DropReason::Expired => GroupDropReason::Expired,
                    DropReason::NoSignal => GroupDropReason::NoSignal,
                },
                trajectories: g.members.len() as u32,
            };
            g.state = GroupState::Exhausted;
            self.ready.remove(g);
            let task = g.task.clone();
            match why {
                // Never served: released now, and the task is open for the
                // attempt the coordinator issues next; the attempts
                // superseded so far stay superseded (as the `Dropped`
                // record says).
                DropReason::Stale => {
                    let closed = self.superseded.get(&task).cloned().unwrap_or_default();
                    self.release(id);
                    self.reopen(&task, id, closed);
                }
                DropReason::Expired => self.settle(id),
                // Never served, and never will be: released now, and the
                // task is done (not issued again, not trained): later
                // attempts of it are superseded, copies of its rows are
                // duplicates.
                DropReason::NoSignal => {
                    self.release(id);
                    self.consumed(task, id.clone());
                }
            }
            dropped.push(info);
        }
        if let Outcome::Serve(groups) = plan.outcome {
            let step = plan.ask.step;
            self.served.insert(
                step,
                ServedStep {
                    version: plan.ask.version,
                    eta: plan.ask.eta,
                    groups: groups.clone(),
                    trained_through: plan.ask.trained_through,
                },
            );
            self.mark_done(plan.ask.trained_through.min(step - 1));
            for id in &groups {
                if let Some(g) = self.groups.get_mut(id) {
                    g.serves += 1;
                    g.last_step = step;
                    if g.serves >= self.max_serves {
                        g.state = GroupState::Exhausted;
                        self.ready.remove(g);
                    }
                }
            }
            if let Some(queue) = plan.reuse_queue {
                self.reuse_queue = queue;
            }
            if let Some(rng) = plan.rng {
                self.rng = rng;
            }
        }
        dropped
    }

    /// Steps up to `through` are trained: release what only they held.
    fn mark_done(&mut self, through: u64) {
        if through <= self.done_through {
            return;
        }
        self.done_through = through;
        let done: Vec<u64> = self.served.range(..=through).map(|(s, _)| *s).collect();
        let mut touched = Vec::new();
        for s in done {
            if let Some(step) = self.served.remove(&s) {
                touched.extend(step.groups);
            }
        }
        for id in touched {
            self.settle(&id);
        }
    }

    /// Releases an exhausted group once no untrained step may ask for it again.
    fn settle(&mut self, id: &Arc<str>) {
        let final_ = self
            .groups
            .get(id)
            .is_some_and(|g| g.state == GroupState::Exhausted && g.last_step <= self.done_through);
        if final_ && let Some(g) = self.release(id) {
            self.consumed(g.task.clone(), g.id.clone());
        }
    }

    /// `group` of `task` will never be served again: later attempts of the
    /// task are superseded, and a stale drop of another attempt is history.
    fn consumed(&mut self, task: Arc<str>, group: Arc<str>) {
        if self
            .stale
            .get(&task)
            .is_some_and(|groups| !groups.contains(&group))
        {
            self.stale.remove(&task);
        }
        self.superseded.remove(&task);
        let seg = self.task_done.get(&task).map_or(0, |d| d.seg);
        self.task_done.insert(
            task,
            Done {
                kept: group,
                consumed: true,
                seg,
            },
        );
    }

    /// The groups dropped as stale whose task is still open (no attempt of
    /// it trained on): `(task, group)`, sorted. A restarted buffer reports
    /// them again, since a report may have been lost with the process.
    pub fn stale_drops(&self) -> Vec<(Arc<str>, Arc<str>)> {
        let mut out: Vec<(Arc<str>, Arc<str>)> = self
            .stale
            .iter()
            .flat_map(|(t, gs)| gs.iter().map(move |g| (t.clone(), g.clone())))
            .collect();
        out.sort_unstable();
        out
    }

    /// `group` of `task` was dropped as stale before it was served: the
    /// coordinator issues the task again, and that attempt must be kept.
    fn reopen(&mut self, task: &Arc<str>, group: &Arc<str>, closed: Vec<Arc<str>>) {
        if self.task_done.get(task).is_some_and(|d| d.kept == *group) {
            self.task_done.remove(task);
        }
        let groups = self.stale.entry(task.clone()).or_default();
        for g in std::iter::once(group.clone()).chain(closed) {
            if !groups.contains(&g) {
                groups.push(g);
            }
        }
    }

    /// The rows of `groups` (members in index order, groups in the given
    /// order): the batches to gather from and `(batch, row)` indices into
    /// that list, ready for `arrow::compute::interleave_record_batch`.
    pub fn gather(&self, groups: &[Arc<str>]) -> Result<Gathered, String> {
        let mut slots: HashMap<u64, usize> = HashMap::new();
        let mut batches = Vec::new();
        let mut indices = Vec::new();
        for id in groups {
            let g = self
                .groups
                .get(id)
                .ok_or_else(|| format!("group `{id}` is not held"))?;
            for m in &g.members {
                let b = self
                    .batches
                    .get(&m.at.batch)
                    .ok_or_else(|| format!("rows of group `{id}` are not in memory"))?;
                let slot = *slots.entry(m.at.batch).or_insert_with(|| {
                    batches.push(b.batch.clone());
                    batches.len() - 1
                });
                indices.push((slot, m.at.row as usize));
            }
        }
        Ok((batches, indices))
    }

    /// The tasks of the complete groups held (ready, or served at a step
    /// not trained yet).
    pub fn held_tasks(&self) -> std::collections::BTreeSet<String> {
        self.groups
            .values()
            .filter(|g| g.state != GroupState::Collecting)
            .map(|g| g.task.to_string())
            .collect()
    }

    /// The task of a held group.
    pub fn group_task(&self, id: &str) -> Option<String> {
        self.groups.get(id).map(|g| g.task.to_string())
    }

    /// The learner version a served step was asked at (for a replay).
    pub fn served_version(&self, step: u64) -> Option<(i32, u32)> {
        self.served.get(&step).map(|s| (s.version, s.eta))
    }

    // ------------------------------------------------------------ recovery

    /// Seeds the core from the served log, before the segments are replayed.
    pub fn seed(&mut self, records: &[Record]) {
        let mut serves: HashMap<GroupRef, Restore> = HashMap::new();
        let mut steps: BTreeMap<u64, ServedStep> = BTreeMap::new();
        let mut step_refs: HashMap<u64, Vec<GroupRef>> = HashMap::new();
        let mut stale_drops: Vec<GroupRef> = Vec::new();
        for r in records {
            match r {
                Record::Snapshot {
                    done_through,
                    consumed,
                    reused,
                    stale,
                    closed_epoch,
                } => {
                    self.done_through = self.done_through.max(*done_through);
                    self.closed_epoch = self.closed_epoch.max(*closed_epoch);
                    for g in consumed {
                        // Its segment is learnt from the rows replayed.
                        self.task_done
                            .insert(Arc::from(g.task.as_str()), Done::consumed(&g.group));
                    }
                    for g in stale {
                        stale_drops.push(g.clone());
                    }
                    for u in reused {
                        let e = serves.entry(u.group.clone()).or_default();
                        e.serves += u.serves;
                        e.expired |= u.expired;
                    }
                }
                Record::Served {
                    step,
                    version,
                    eta,
                    groups,
                    trained_through,
                    ..
                } => {
                    let trained_through = trained_through
                        .unwrap_or(step.saturating_sub(1))
                        .min(step.saturating_sub(1));
                    self.done_through = self.done_through.max(trained_through);
                    for g in groups {
                        let e = serves.entry(g.clone()).or_default();
                        e.serves += 1;
                        e.last_step = e.last_step.max(*step);
                    }
                    step_refs.insert(*step, groups.clone());
                    steps.insert(
                        *step,
                        ServedStep {
                            version: *version,
                            eta: *eta,
                            groups: groups.iter().map(|g| Arc::from(g.group.as_str())).collect(),
                            trained_through,
                        },
                    );
                }
                Record::Refused {
                    step,
                    groups,
                    stale,
                    ..
                } => {
                    let quarantined: HashSet<&str> =
                        groups.iter().map(|q| q.group.group.as_str()).collect();
                    steps.remove(step);
                    for g in step_refs.remove(step).unwrap_or_default() {
                        if !quarantined.contains(g.group.as_str())
                            && let Some(e) = serves.get_mut(&g)
                        {
                            e.serves = e.serves.saturating_sub(1);
                            // As `unserve`: the latest step still holding it.
                            e.last_step = step_refs
                                .iter()
                                .filter(|(_, gs)| gs.contains(&g))
                                .map(|(s, _)| *s)
                                .max()
                                .unwrap_or(e.last_step.min(self.done_through));
                        }
                    }
                    // Quarantined, and the step's groups that became stale
                    // drops: both as a stale drop.
                    for q in groups.iter().chain(stale) {
                        let e = serves.entry(q.group.clone()).or_default();
                        e.expired = true;
                        e.serves = e.serves.max(self.max_serves);
                        stale_drops.push(q.group.clone());
                        for c in &q.closed {
                            stale_drops.push(GroupRef {
                                task: q.group.task.clone(),
                                group: c.clone(),
                            });
                        }
                    }
                }
                Record::Dropped {
                    group,
                    reason,
                    closed,
                    ..
                } => {
                    let e = serves.entry(group.clone()).or_default();
                    match reason {
                        DropReason::Stale => {
                            e.expired = true;
                            e.serves = e.serves.max(self.max_serves);
                            stale_drops.push(group.clone());
                            for c in closed {
                                stale_drops.push(GroupRef {
                                    task: group.task.clone(),
                                    group: c.clone(),
                                });
                            }
                        }
                        DropReason::Expired => e.expired = true,
                        // Done without training: its rows are skipped
                        // (whatever `min_reward_spread` is now), later
                        // attempts superseded, and it is not reported
                        // again.
                        DropReason::NoSignal => {
                            serves.remove(group);
                            self.task_done.insert(
                                Arc::from(group.task.as_str()),
                                Done::consumed(&group.group),
                            );
                        }
                    }
                }
            }
        }
        self.served = steps.split_off(&(self.done_through + 1));
        // A stale drop's task stays open for its next attempt, unless an
        // attempt of it was trained on since.
        for g in stale_drops {
            serves.remove(&g);
            let (task, group) = (Arc::from(g.task.as_str()), Arc::from(g.group.as_str()));
            match self.task_done.get(&task) {
                Some(d) if d.consumed && d.kept != group => {}
                _ => self.reopen(&task, &group, Vec::new()),
            }
        }
        for (g, r) in serves {
            let exhausted = r.expired || r.serves >= self.max_serves;
            if exhausted && r.last_step <= self.done_through {
                // Final: never served again, rows not needed.
                self.task_done
                    .insert(Arc::from(g.task.as_str()), Done::consumed(&g.group));
            } else {
                self.restore.insert(Arc::from(g.group.as_str()), r);
            }
        }
    }

    /// Ends recovery: applies the served log to the replayed groups.
    /// Returns the groups the log names whose rows are missing.
    pub fn finish_recovery(&mut self) -> Vec<String> {
        let mut missing = Vec::new();
        for (id, r) in std::mem::take(&mut self.restore) {
            let Some(g) = self.groups.get_mut(&id) else {
                missing.push(id.to_string());
                continue;
            };
            if g.state == GroupState::Collecting {
                missing.push(id.to_string());
                continue;
            }
            g.serves = r.serves;
            g.last_step = r.last_step;
            if r.expired || g.serves >= self.max_serves {
                g.state = GroupState::Exhausted;
                self.ready.remove(g);
            }
            self.settle(&id);
        }
        if self.sampling == SamplingPolicy::Reuse {
            let mut pool: Vec<Arc<str>> = self
                .ready
                .ids()
                .filter(|id| self.groups.get(*id).is_some_and(|g| self.eligible(g)))
                .cloned()
                .collect();
            pool.shuffle(&mut self.rng);
            self.reuse_queue = pool.into();
        }
        missing
    }

    /// The records that replace the whole served log (compaction): one
    /// snapshot, then the served steps that are not trained yet.
    pub fn snapshot(&self) -> Vec<Record> {
        let mut pending: HashMap<&Arc<str>, u32> = HashMap::new();
        for s in self.served.values() {
            for g in &s.groups {
                *pending.entry(g).or_default() += 1;
            }
        }
        let mut consumed: Vec<GroupRef> = self
            .task_done
            .iter()
            .filter(|(_, d)| d.consumed)
            .map(|(t, d)| GroupRef {
                task: t.to_string(),
                group: d.kept.to_string(),
            })
            .collect();
        consumed.sort_by(|a, b| a.group.cmp(&b.group));
        let mut reused: Vec<crate::statelog::Reused> = self
            .groups
            .values()
            .filter(|g| g.serves > 0 || g.state == GroupState::Exhausted)
            .filter_map(|g| {
                let in_steps = pending.get(&g.id).copied().unwrap_or(0);
                let before = g.serves.saturating_sub(in_steps);
                let expired = g.state == GroupState::Exhausted && g.serves < self.max_serves;
                (before > 0 || expired).then(|| crate::statelog::Reused {
                    group: g.gref(),
                    serves: before,
                    expired,
                })
            })
            .collect();
        reused.sort_by(|a, b| a.group.group.cmp(&b.group.group));
        let mut stale: Vec<GroupRef> = self
            .stale
            .iter()
            .flat_map(|(task, groups)| {
                groups.iter().map(|g| GroupRef {
                    task: task.to_string(),
                    group: g.to_string(),
                })
            })
            .collect();
        stale.sort_by(|a, b| a.group.cmp(&b.group));
        let mut out = vec![Record::Snapshot {
            done_through: self.done_through,
            consumed,
            reused,
            stale,
            closed_epoch: self.closed_epoch,
        }];
        for (step, s) in &self.served {
            out.push(Record::Served {
                step: *step,
                version: s.version,
                eta: s.eta,
                groups: s
                    .groups
                    .iter()
                    .filter_map(|id| self.groups.get(id).map(Group::gref))
                    .collect(),
                unix_ms: 0,
                trained_through: Some(s.trained_through),
            });
        }
        out
    }

    pub fn stats(&self) -> Stats {
        let mut s = Stats {
            ready_groups: self.ready.len(),
            live_trajectories: self.live_rows,
            live_tokens: self.live_tokens,
            resident_bytes: self.resident_bytes,
            memory_batches: self.batches.len(),
            done_through: self.done_through,
            pending_steps: self.served.len(),
            completed_tasks: self.task_done.len(),
            closed_epoch: self.closed_epoch,
            ..Default::default()
        };
        for g in self.groups.values() {
            match g.state {
                GroupState::Collecting => s.collecting_groups += 1,
                GroupState::Ready => {}
                GroupState::Exhausted => s.exhausted_groups += 1,
            }
        }
        s
    }

    /// The oldest policy version of a held group (for staleness metrics).
    pub fn group_oldest(&self, id: &str) -> Option<i32> {
        self.groups.get(id).map(Group::oldest)
    }
}

#[cfg(test)]
mod tests;
