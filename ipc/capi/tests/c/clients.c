/*
 * Sandboxes as a whole through libbelayer: creation with every option (and their effect),
 * inspection and listing with the configuration, checkpoint listing, restore of a chosen
 * prefix, gc by tag and by age, and bad options across the ABI.
 *
 * Usage: clients <belayerd socket> <busybox rootfs>. Exit 0 on success; on failure prints the
 * failed check with belayer_last_error() and exits 1.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "belayer.h"
#include "check.h"

/* Runs `cmd` (cwd `cwd`, NULL: the sandbox's workdir); stores the status, and stdout in `buf`. */
static int run(BelayerClient c, const char *id, const char *cmd, const char *cwd, char *buf,
               size_t len) {
    BelayerExecOptions opts;
    BelayerExecResult r;
    memset(&opts, 0, sizeof opts);
    opts.cwd = cwd;
    opts.timeout_ms = 60000;
    int rc = belayer_exec_with(c, id, cmd, &opts, &r, NULL);
    if (rc == BELAYER_OK && buf) {
        size_t n = r.stdout_buf.len < len - 1 ? r.stdout_buf.len : len - 1;
        memcpy(buf, r.stdout_buf.data, n);
        buf[n] = 0;
    }
    if (rc == BELAYER_OK && r.exit_code != 0) rc = 1000 + r.exit_code;
    belayer_exec_result_free(&r);
    return rc;
}

/* Whether the list holds `id`; copies its entry's workdir into `workdir`. */
static int listed(const BelayerSandboxList *list, const char *id, const char **workdir) {
    for (size_t i = 0; i < list->len; i++) {
        if (strcmp(list->items[i].info.id, id) == 0) {
            *workdir = list->items[i].config.workdir;
            return 1;
        }
    }
    return 0;
}

static int bad_options(BelayerClient c) {
    BelayerCreateOptions o;
    char *id = NULL;
    const char *env_bad[] = {"NOEQUALS"};
    const char bad_utf8[] = {(char)0xff, 0};
    BelayerGcResult gc;

    memset(&o, 0, sizeof o);
    o.cpus = NAN;
    CHECK(belayer_sandbox_create_with(c, "busybox", &o, &id) == BELAYER_E_INVALID_ARGUMENT);
    CHECK(strstr(belayer_last_error(), "cpus") != NULL);
    o.cpus = -1.0;
    CHECK(belayer_sandbox_create_with(c, "busybox", &o, &id) == BELAYER_E_INVALID_ARGUMENT);
    o.cpus = 0;
    o.userns = 7;
    CHECK(belayer_sandbox_create_with(c, "busybox", &o, &id) == BELAYER_E_INVALID_ARGUMENT);
    CHECK(strstr(belayer_last_error(), "userns") != NULL);
    o.userns = BELAYER_USERNS_DEFAULT;
    o.env_len = 1;
    CHECK(belayer_sandbox_create_with(c, "busybox", &o, &id) == BELAYER_E_INVALID_ARGUMENT);
    o.env = env_bad;
    CHECK(belayer_sandbox_create_with(c, "busybox", &o, &id) == BELAYER_E_INVALID_ARGUMENT);
    CHECK(strstr(belayer_last_error(), "options.env[0]") != NULL);
    o.env = NULL;
    o.env_len = 0;
    o.workdir = "relative";
    CHECK(belayer_sandbox_create_with(c, "busybox", &o, &id) == BELAYER_E_BAD_REQUEST);
    CHECK(strstr(belayer_last_error(), "workdir") != NULL);
    o.workdir = bad_utf8;
    CHECK(belayer_sandbox_create_with(c, "busybox", &o, &id) == BELAYER_E_INVALID_ARGUMENT);
    o.workdir = NULL;
    o.memory_max = 4096;
    CHECK(belayer_sandbox_create_with(c, "busybox", &o, &id) == BELAYER_E_BAD_REQUEST);
    CHECK(id == NULL);
    CHECK(belayer_sandbox_create_with(c, "busybox", NULL, NULL) == BELAYER_E_INVALID_ARGUMENT);
    CHECK(belayer_gc(c, -1, NULL, &gc) == BELAYER_E_BAD_REQUEST);
    CHECK(gc.removed == 0 && gc.bytes == 0);
    CHECK(belayer_gc(c, -1, bad_utf8, NULL) == BELAYER_E_INVALID_ARGUMENT);
    CHECK(belayer_sandbox_list(c, NULL) == BELAYER_E_INVALID_ARGUMENT);
    CHECK(belayer_checkpoint_list(c, "sb-000000000000", NULL) == BELAYER_E_INVALID_ARGUMENT);
    /* Frees accept NULL and zeroed structs, twice. */
    belayer_sandbox_list_free(NULL);
    belayer_checkpoint_list_free(NULL);
    belayer_sandbox_entry_free(NULL);
    return 0;
out:
    return 1;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s SOCKET ROOTFS\n", argv[0]);
        return 2;
    }
    const char *socket = argv[1], *rootfs = argv[2];
    BelayerClient c = 0;
    char *id = NULL, *other = NULL;
    char out[4096], tag[64];
    const char *env[] = {"MODE=strict", "EMPTY="};
    const char *workdir = NULL;
    BelayerCreateOptions o;
    BelayerSandboxEntry e;
    BelayerSandboxList list;
    BelayerCheckpointList cps;
    BelayerRestoreInfo restored;
    BelayerForkInfo fk;
    BelayerGcResult gc;
    uint64_t dropped = 99;

    memset(&e, 0, sizeof e);
    memset(&list, 0, sizeof list);
    memset(&cps, 0, sizeof cps);
    memset(&restored, 0, sizeof restored);
    memset(&fk, 0, sizeof fk);
    snprintf(tag, sizeof tag, "c-gc-%ld", (long)time(NULL));

    CHECK(belayer_abi_version() == BELAYER_ABI_VERSION);
    OK(belayer_connect(socket, &c));
    int rc = belayer_image_import(c, "busybox", rootfs);
    CHECK(rc == BELAYER_OK || rc == BELAYER_E_ALREADY_EXISTS);
    if (bad_options(c)) goto out;

    memset(&o, 0, sizeof o);
    o.tag = tag;
    o.env = env;
    o.env_len = 2;
    o.workdir = "/srv";
    o.memory_max = 64u << 20;
    o.pids_max = 12;
    o.cpus = 0.5;
    o.disk_max = 32u << 20;
    o.userns = BELAYER_USERNS_PRIVATE;
    OK(belayer_sandbox_create_with(c, "busybox", &o, &id));
    OK(belayer_sandbox_create_with(c, "busybox", NULL, &other));

    OK(belayer_sandbox_inspect_with(c, id, &e));
    CHECK(strcmp(e.info.id, id) == 0 && strcmp(e.info.state, "running") == 0);
    CHECK(e.info.init_pid > 0 && e.info.pids_len >= 1 && !e.info.has_ready_prefix);
    CHECK(strcmp(e.config.tag, tag) == 0 && strcmp(e.config.workdir, "/srv") == 0);
    CHECK(e.config.env_len == 2 && strcmp(e.config.env[0], "MODE=strict") == 0);
    CHECK(strcmp(e.config.env[1], "EMPTY=") == 0);
    CHECK(e.config.memory_max == 64u << 20 && e.config.pids_max == 12);
    CHECK(e.config.cpus == 0.5 && e.config.disk_max == 32u << 20);
    CHECK(e.config.userns == BELAYER_USERNS_PRIVATE && strstr(e.config.cgroup, id) != NULL);
    belayer_sandbox_entry_free(&e);
    belayer_sandbox_entry_free(&e);
    CHECK(e.config.env == NULL && e.info.id == NULL);

    /* The workdir is every action's default cwd; it is not created. */
    CHECK(run(c, id, "pwd", NULL, out, sizeof out) == BELAYER_E_EXEC_FAILED);
    CHECK(strstr(belayer_last_error(), "/srv") != NULL);
    OK(run(c, id, "mkdir -p /srv", "/", NULL, 0));
    OK(run(c, id, "pwd; echo $MODE", NULL, out, sizeof out));
    CHECK(strcmp(out, "/srv\nstrict\n") == 0);
    /* pids_max holds against a fork bomb (counted with shell builtins). */
    OK(run(c, id, "(for i in $(seq 40); do sleep 60 & done) 2>/dev/null; "
                  "set -- /proc/[0-9]*; echo $#", NULL, out, sizeof out));
    CHECK(atoi(out) > 5 && atoi(out) <= 12);
    OK(run(c, id, "kill -9 -1 2>/dev/null; true", NULL, NULL, 0));

    /* Checkpoints 1..3, listed oldest first with their publication times. */
    for (uint64_t k = 1; k <= 3; k++) {
        char cmd[64], ctx[16];
        snprintf(cmd, sizeof cmd, "echo k%llu >> log", (unsigned long long)k);
        snprintf(ctx, sizeof ctx, "ctx%llu", (unsigned long long)k);
        OK(run(c, id, cmd, NULL, NULL, 0));
        OK(belayer_checkpoint(c, id, k, (const uint8_t *)ctx, strlen(ctx), NULL));
    }
    OK(belayer_checkpoint_list(c, id, &cps));
    CHECK(cps.len == 3 && cps.items[0].info.prefix == 1 && cps.items[2].info.prefix == 3);
    CHECK(cps.items[0].created_unix_ms > 0 && cps.items[0].info.bytes > 0);
    CHECK(strlen(cps.items[1].info.context_digest) == 64);
    belayer_checkpoint_list_free(&cps);
    belayer_checkpoint_list_free(&cps);
    CHECK(cps.items == NULL && cps.len == 0);

    /* Restore of the middle prefix: C_2 becomes the ready checkpoint, C_3 stays as a branch. */
    OK(belayer_restore_to(c, id, 2, true, &restored, &dropped));
    CHECK(restored.has_prefix && restored.prefix == 2 && dropped == 0);
    CHECK(restored.context.len == 4 && memcmp(restored.context.data, "ctx2", 4) == 0);
    CHECK(restored.verified && restored.fs_matches && restored.processes_match);
    belayer_restore_info_free(&restored);
    OK(run(c, id, "cat log", NULL, out, sizeof out));
    CHECK(strcmp(out, "k1\nk2\n") == 0);
    OK(belayer_checkpoint_list(c, id, &cps));
    CHECK(cps.len == 3 && cps.items[1].info.prefix == 2 && cps.items[2].info.prefix == 3);
    belayer_checkpoint_list_free(&cps);
    dropped = 99;
    CHECK(belayer_restore_to(c, id, 7, false, &restored, &dropped) == BELAYER_E_NOT_FOUND);
    CHECK(strstr(belayer_last_error(), "prefix 7") != NULL && dropped == 0);
    CHECK(!restored.has_prefix && restored.context.data == NULL);
    belayer_restore_info_free(&restored);
    OK(belayer_restore_to(c, id, 2, false, &restored, NULL));
    CHECK(restored.prefix == 2 && !restored.verified);
    belayer_restore_info_free(&restored);

    /* Fork: three children from C_2 (by prefix), each with C_2's files and L_2; then one
     * from C_3 by name, on the branch. Bad counts are refused and leave nothing. */
    OK(belayer_fork(c, id, NULL, true, 2, 3, true, &fk));
    CHECK(fk.children_len == 3 && fk.prefix == 2 && strncmp(fk.fork, "fk-", 3) == 0);
    CHECK(fk.context.len == 4 && memcmp(fk.context.data, "ctx2", 4) == 0);
    CHECK(strcmp(fk.checkpoint, "c000002-k2") == 0 && fk.total_ms > 0);
    for (size_t i = 0; i < fk.children_len; i++) {
        CHECK(fk.children[i].verified && fk.children[i].fs_matches);
        CHECK(fk.children[i].processes_match && fk.children[i].init_pid > 0);
        OK(run(c, fk.children[i].id, "cat log", NULL, out, sizeof out));
        CHECK(strcmp(out, "k1\nk2\n") == 0);
        OK(belayer_sandbox_destroy(c, fk.children[i].id));
    }
    belayer_fork_info_free(&fk);
    belayer_fork_info_free(&fk);
    CHECK(fk.children == NULL && fk.children_len == 0 && fk.fork == NULL);
    OK(belayer_fork(c, id, "c000003-k3", false, 0, 1, false, &fk));
    CHECK(fk.children_len == 1 && fk.prefix == 3 && !fk.children[0].verified);
    OK(run(c, fk.children[0].id, "cat log", NULL, out, sizeof out));
    CHECK(strcmp(out, "k1\nk2\nk3\n") == 0);
    OK(belayer_sandbox_destroy(c, fk.children[0].id));
    belayer_fork_info_free(&fk);
    CHECK(belayer_fork(c, id, NULL, false, 0, 0, false, &fk) == BELAYER_E_BAD_REQUEST);
    CHECK(fk.children == NULL && fk.fork == NULL);
    CHECK(belayer_fork(c, id, NULL, true, 7, 1, false, &fk) == BELAYER_E_NOT_FOUND);

    /* Listing: both sandboxes, with their configurations. */
    OK(belayer_sandbox_list(c, &list));
    CHECK(listed(&list, id, &workdir) && workdir != NULL && strcmp(workdir, "/srv") == 0);
    CHECK(listed(&list, other, &workdir) && workdir == NULL);
    belayer_sandbox_list_free(&list);
    belayer_sandbox_list_free(&list);
    CHECK(list.items == NULL && list.len == 0);

    /* gc by tag: every checkpoint of the tagged sandbox, ready one and branch included. */
    OK(belayer_checkpoint(c, other, 1, NULL, 0, NULL));
    OK(belayer_checkpoint(c, other, 2, NULL, 0, NULL));
    OK(belayer_gc(c, -1, tag, &gc));
    CHECK(gc.removed == 3 && gc.bytes > 0);
    OK(belayer_checkpoint_list(c, id, &cps));
    CHECK(cps.len == 0);
    belayer_checkpoint_list_free(&cps);
    /* gc by age: the untagged sandbox keeps its ready checkpoint. */
    OK(belayer_gc(c, 0, NULL, &gc));
    CHECK(gc.removed >= 1);
    OK(belayer_checkpoint_list(c, other, &cps));
    CHECK(cps.len == 1 && cps.items[0].info.prefix == 2);
    belayer_checkpoint_list_free(&cps);

    OK(belayer_sandbox_destroy(c, id));
    OK(belayer_sandbox_destroy(c, other));
    printf("clients ok\n");
out:
    belayer_sandbox_entry_free(&e);
    belayer_sandbox_list_free(&list);
    belayer_checkpoint_list_free(&cps);
    belayer_restore_info_free(&restored);
    belayer_fork_info_free(&fk);
    belayer_string_free(&id);
    belayer_string_free(&other);
    if (c) belayer_close(c);
    return failures ? 1 : 0;
}
