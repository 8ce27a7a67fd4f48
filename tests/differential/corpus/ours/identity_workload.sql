-- OURS: workload for identity.sql (one transaction per unit, units separated by blank lines)
INSERT INTO id_always_key (v) VALUES ('a');
INSERT INTO id_always_nonkey (k) VALUES ('b');

INSERT INTO id_always_key (v) SELECT 'bulk ' || g FROM generate_series(1, 2000) g;

UPDATE id_always_key SET v = v || ' updated' WHERE id % 7 = 0;
UPDATE id_always_key SET id = DEFAULT WHERE id = 3;

UPDATE id_always_nonkey SET n = DEFAULT WHERE k = 'b';
DELETE FROM id_always_key WHERE id % 5 = 0;
