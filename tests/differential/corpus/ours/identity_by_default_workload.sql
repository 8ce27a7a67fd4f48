-- OURS: workload for identity_by_default.sql
INSERT INTO id_default_key (v) VALUES ('a'), ('b');
INSERT INTO id_default_key (id, v) VALUES (1000, 'explicit');

INSERT INTO id_default_nonkey (k) SELECT g FROM generate_series(10, 1500) g;

UPDATE id_default_key SET id = id + 5000 WHERE v = 'a';
UPDATE id_default_nonkey SET n = DEFAULT WHERE k < 20;

DELETE FROM id_default_nonkey WHERE k % 3 = 0;
